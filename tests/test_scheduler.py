"""The scheduler and page allocator alone: plain Python, no model."""

from __future__ import annotations

import pytest

from sparseengine.engine.page_allocator import OutOfPages, PageAllocator
from sparseengine.engine.scheduler import Scheduler, SchedulerConfig
from sparseengine.engine.sequence import Sequence, SequenceStatus
from sparseengine.sampling_params import SamplingParams


def make(num_pages=16, **kw):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=32, page_size=4, max_model_len=256)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg), PageAllocator(num_pages))


def seq(n, max_tokens=8):
    return Sequence(list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens), num_layers=2)


def run_step(s: Scheduler, token=7):
    batch = s.schedule()
    s.advance(batch)
    for q, n in zip(batch.seqs, batch.num_new_tokens):
        if q.num_computed_tokens == q.num_tokens:
            q.output_token_ids.append(token)
    return batch


def test_allocator_counts_and_errors():
    a = PageAllocator(3)
    pages = a.allocate(2)
    assert a.num_free == 1 and a.peak_used == 2
    with pytest.raises(OutOfPages):
        a.allocate(2)
    a.free(pages)
    with pytest.raises(ValueError, match="not in use"):
        a.free(pages[:1])


def test_chunked_prefill_respects_token_budget_and_chunk():
    s = make(num_pages=64)
    a, b = seq(50), seq(20)
    s.add(a), s.add(b)
    batch = s.schedule()
    assert batch.num_new_tokens == [32, 20]  # a: one chunk of 32; b fits in the rest
    s.advance(batch)
    batch = s.schedule()
    assert batch.seqs == [a] and batch.num_new_tokens == [18]


def test_decodes_go_first_then_prefill():
    s = make(num_pages=64)
    a = seq(8)
    s.add(a)
    run_step(s)
    b = seq(40)
    s.add(b)
    batch = s.schedule()
    assert batch.seqs[0] is a and batch.num_new_tokens[0] == 1
    assert batch.seqs[1] is b and batch.num_new_tokens[1] == 32


def test_max_num_seqs():
    s = make(num_pages=64, max_num_seqs=2)
    for _ in range(3):
        s.add(seq(4))
    batch = s.schedule()
    assert len(batch.seqs) == 2 and len(s.waiting) == 1


def test_preemption_by_recompute_when_pool_is_full():
    s = make(num_pages=4)  # 16 slots
    a, b = seq(8), seq(8)
    s.add(a), s.add(b)
    run_step(s)  # both prefilled: 2 pages each, pool full
    batch = s.schedule()  # a needs a third page: b (newest) is preempted
    assert b in batch.preempted and b.status == SequenceStatus.WAITING and b.page_table == []
    assert batch.seqs == [a] and b.num_computed_tokens == 0 and b.num_preemptions == 1


def test_request_that_can_never_fit_fails_alone():
    s = make(num_pages=2)
    a = seq(8, max_tokens=20)
    s.add(a)
    run_step(s)
    batch = s.schedule()
    assert a in batch.failed and a.finish_reason == "error" and "KV pool exhausted" in a.error
    assert s.allocator.num_used == 0


def test_validate_messages():
    s = make(num_pages=4, max_model_len=10)
    assert "empty prompt" in s.validate(seq(0))
    assert "max_model_len=10" in s.validate(seq(11))
    assert "KV pages" in make(num_pages=2).validate(seq(9))


def test_long_prompt_runs_alone_unchunked():
    s = make(num_pages=64, prefill_policy="long_bs1full_short_batch", long_prefill_threshold=40)
    short, long_ = seq(10), seq(60)
    s.add(short)
    run_step(s)
    s.add(long_)
    batch = s.schedule()
    assert batch.seqs == [long_] and batch.num_new_tokens == [60]


def test_trim_pages_returns_pages_after_eviction():
    s = make(num_pages=16)
    a = seq(30)
    s.add(a)
    run_step(s)
    assert len(a.page_table) == 8
    a.layer_lens = [9, 5]
    assert s.trim_pages(a) == 5 and len(a.page_table) == 3 and s.allocator.num_free == 13


def test_growth_past_the_narrow_bound_takes_wide_pages():
    """A two-tier pool: a request's logical pages below its narrow bound come from the
    narrow tier, the rest from the wide one (narrow pages where it runs out)."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=64, page_size=4,
                                  max_model_len=256), PageAllocator(12, narrow_pages=6))
    q = seq(10, max_tokens=20)
    bound = {}
    s.narrow_bound = lambda r: bound.get(r.seq_id)
    s.add(q)
    run_step(s)  # prefill: 3 pages, all narrow (no bound yet)
    assert q.page_table == [0, 1, 2]
    bound[q.seq_id] = 6  # compressed: its narrow layers hold cache indices < 6 (2 pages)
    for _ in range(3):
        run_step(s)  # tokens 10..12 need page 3 (wide: past page 2 of the bound)
    assert q.page_table[:3] == [0, 1, 2] and q.page_table[3] == 6
    while len(q.page_table) < 9:
        run_step(s)
    assert q.page_table[3:] == [6, 7, 8, 9, 10, 11] and s.allocator.num_free_narrow == 3
    assert s._pages_needed(q, 4) == (0, 1)
    bound[q.seq_id] = 60  # a bound past its pages: new pages narrow
    assert s._pages_needed(q, 4) == (1, 0)


def test_validate_counts_only_narrow_pages_for_a_prompt():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=32, page_size=4,
                                  max_model_len=256), PageAllocator(40, narrow_pages=8))
    said = s.validate(seq(33))
    assert "needs 9 KV pages but the pool holds 8 narrow pages (of 40)" in said
    assert "kv_pool_tier_tokens" in said and "kv_pool_tiers=off" in said  # what to change, by name
    assert s.validate(seq(32)) is None
