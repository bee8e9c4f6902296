"""DeltaKV in a two-tier pool (engine/pool_plan.py) on a tiny random Llama: its sparse
layers hold pages only in the narrow tier, and a compressed request's other pages move to
the wide tier, which stores only the full layers.

- the tiered pool generates the same tokens as the one-tier pool (``kv_pool_tiers=off``):
  the same computation with the pages placed elsewhere; through prefill, the first
  compression, a history flush, a batch mixing prefill and decode, and a synthesised
  prefill;
- the sparse layers never reach past DeltaKV's ``narrow_tokens`` once compressed, and
  every page past it is in the wide tier;
- the same memory holds more max_model_len requests than one tier, and the throughput
  benchmark's capacity model's largest batch runs in it;
- pages go back to their tier when requests finish;
- ``kv_pool_tier_tokens`` sizes the tiers for shorter requests: more of them fit.
"""

from __future__ import annotations

import itertools

import pytest

from experiments.throughput import capacity
from sparseengine import LLM, SamplingParams
from sparseengine.config import ConfigError
from sparseengine.engine import sequence
from sparseengine.engine.page_allocator import PageAllocator
from sparseengine.methods import deltakv

from tests.methods.test_deltakv_engine import BUDGET, FULL, PROMPT, PROMPT2, RECENT, SINK, SPARSE, _ids
from tests.methods.test_deltakv_engine import ckpt32 as ckpt, folder  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/methods/conftest.py

MAX_LEN = 512
GIB = 2 / 1024  # 2 MiB: 128 one-tier pages of 16 tokens in the tiny Llama (float32), 4 requests of 512


def _llm(folder, ckpt, **kw):
    base = dict(device="cpu", sparse_method="deltakv", deltakv_full_layers=FULL, deltakv_latent_dim=32,
                deltakv_checkpoint_path=str(ckpt.path), sink_tokens=SINK, recent_tokens=RECENT, budget=BUDGET,
                max_model_len=MAX_LEN, kv_cache_memory=GIB, prefill_chunk_size=64)
    return LLM(folder, **{**base, **kw})


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _watch(llm):
    """Spy on every flush: the sparse layers' longest length and any page past the narrow
    bound that is not in the wide tier, once a request is compressed."""
    rt, alloc, seen = llm.method, llm.allocator, {"longest": 0, "narrow_past_bound": 0, "compressed": 0}
    flush = rt._flush

    def spy(seq):
        flush(seq)
        bound = rt.narrow_bound(seq)
        if bound is None:
            return
        seen["compressed"] += 1
        seen["longest"] = max(seen["longest"], *(seq.layer_lens[layer] for layer in SPARSE))
        first = -(-bound // llm.config.page_size)
        seen["narrow_past_bound"] += sum(alloc.is_narrow(p) for p in seq.page_table[first:])

    rt._flush = spy
    return seen


def test_the_plan_makes_two_tiers_and_holds_more_requests(folder, ckpt):
    tiered, flat = _llm(folder, ckpt), _llm(folder, ckpt, kv_pool_tiers="off")
    plan = tiered.pool_plan
    assert plan.tiered and plan.narrow_layers == SPARSE and not flat.pool_plan.tiered
    assert flat.allocator.num_pages == plan.one_tier_pages == 128
    assert plan.requests > flat.allocator.num_pages // (MAX_LEN // 16)
    k, _ = tiered.kv_cache.layer(SPARSE[0])
    assert k.shape[0] == plan.narrow_pages < tiered.kv_cache.layer(0)[0].shape[0] == plan.num_pages
    assert tiered.kv_cache.nbytes < flat.kv_cache.nbytes  # the codec's share stays outside the pool
    with pytest.raises(ValueError, match="differ in pages"):
        tiered.kv_cache.k


def test_tiers_generate_what_one_tier_generates(folder, ckpt):
    """Prefill, first compression, a flush (90 steps > RECENT + 64), a mixed batch, and the
    page placement the tiers promise."""
    prompts = [_ids(300, 5), PROMPT, PROMPT2]
    sp = _greedy(90)
    want = [o.token_ids for o in _llm(folder, ckpt, kv_pool_tiers="off").generate(prompts, sp)]
    llm = _llm(folder, ckpt)
    seen = _watch(llm)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    assert seen["compressed"] > 0 and seen["narrow_past_bound"] == 0
    assert seen["longest"] <= deltakv.DeltaKV.narrow_tokens(llm.config, llm.model_config, 300)
    assert llm.allocator.num_used == 0  # every page back in its tier
    assert llm.allocator.num_free_narrow == llm.allocator.narrow_pages


def test_synthesized_prefill_in_tiers(folder, ckpt, monkeypatch):
    """The decode benchmark's path: synthesised requests move to the wide tier, decode like
    one tier's, and the capacity model's largest batch is what the engine admits."""
    prompts = [_ids(400, s) for s in range(3)]
    sp = _greedy(70)
    off, llm = _llm(folder, ckpt, kv_pool_tiers="off"), _llm(folder, ckpt)
    seen = _watch(llm)
    runs = []
    for engine in (off, llm):  # the same request ids: a synthesised cache is seeded by them
        monkeypatch.setattr(sequence, "_ids", itertools.count(1000))
        runs.append([o.token_ids for o in engine.generate(prompts, sp, prefill="synthesized")])
    assert runs[0] == runs[1]
    assert seen["narrow_past_bound"] == 0
    cap = capacity.capacity_of(llm, 400, 70)
    largest = capacity.max_batch(cap.fits).largest
    one_tier = capacity.max_batch(cap.dense().fits).largest
    assert largest > one_tier
    many = [_ids(400, s) for s in range(largest)]  # held at once: a synthesised batch that does not fit raises
    assert all(o.finish_reason == "length" for o in llm.generate(many, _greedy(70), prefill="synthesized"))
    assert cap.reason(largest + 1).startswith(
        f"needs {cap.pages(largest + 1)} narrow KV pages, the narrow tier holds {cap.narrow_tier} (the wide tier's ")


def test_tiers_sized_for_shorter_requests(folder, ckpt, monkeypatch):
    """kv_pool_tier_tokens: tiers sized for requests of 240 tokens (200 prompt + 40 output;
    max_model_len 512) hold more narrow pages and more such requests than tiers sized for
    max_model_len (the capacity model's count, which is the plan's); its largest batch of
    them runs, and they decode as in one tier."""
    prompt, out = 200, 40
    default, sized = _llm(folder, ckpt), _llm(folder, ckpt, kv_pool_tier_tokens=prompt + out)
    assert sized.pool_plan.tiered and sized.pool_plan.narrow_pages > default.pool_plan.narrow_pages
    largest = [capacity.max_batch(capacity.capacity_of(e, prompt, out).fits).largest for e in (default, sized)]
    assert largest[1] == sized.pool_plan.requests > largest[0]
    prompts = [_ids(prompt, s) for s in range(3)]
    runs = []
    for engine in (_llm(folder, ckpt, kv_pool_tiers="off"), sized):
        monkeypatch.setattr(sequence, "_ids", itertools.count(2000))
        runs.append([o.token_ids for o in engine.generate(prompts, _greedy(out), prefill="synthesized")])
    assert runs[0] == runs[1]
    many = [_ids(prompt, s) for s in range(largest[1])]  # held at once: a synthesised batch that does not fit raises
    assert all(o.finish_reason == "length" for o in sized.generate(many, _greedy(out), prefill="synthesized"))
    assert sized.allocator.num_used == 0


def test_tier_tokens_are_checked(folder, ckpt):
    with pytest.raises(ConfigError, match="kv_pool_tier_tokens=513 is longer than max_model_len=512"):
        _llm(folder, ckpt, kv_pool_tier_tokens=MAX_LEN + 1)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ConfigError, match=f"Invalid kv_pool_tier_tokens={bad!r}: must be a positive integer"):
            _llm(folder, ckpt, kv_pool_tier_tokens=bad)
    with pytest.raises(ConfigError, match="kv_pool_tier_tokens=256 sizes two tiers, but kv_pool_tiers='off'"):
        _llm(folder, ckpt, kv_pool_tier_tokens=256, kv_pool_tiers="off")


def test_allocator_tiers():
    a = PageAllocator(10, narrow_pages=4)
    assert a.allocate(2, 3) == [0, 1, 4, 5, 6]
    assert not a.can_allocate(3) and a.can_allocate(2, 3)
    assert a.allocate(0, 5) == [7, 8, 9, 2, 3]  # the wide tier runs out: narrow pages serve
    a.free([5, 2])
    assert a.num_free_narrow == 1 and a.num_free == 2 and a.take_wide(3) == [5]
    with pytest.raises(Exception, match="1 narrow and 0 wide free"):
        a.allocate(2)
    with pytest.raises(ValueError, match="narrow_pages must be"):
        PageAllocator(4, narrow_pages=5)


@pytest.mark.gpu
def test_tiers_generate_what_one_tier_generates_on_a_gpu(folder, ckpt):
    """The same on CUDA: Triton kernels and decode graphs replayed between flushes (float32)."""
    kw = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    prompts, sp = [_ids(300, 5), PROMPT, PROMPT2], _greedy(90)
    want = [o.token_ids for o in _llm(folder, ckpt, kv_pool_tiers="off", **kw).generate(prompts, sp)]
    llm = _llm(folder, ckpt, **kw)
    assert llm.pool_plan.tiered
    seen = _watch(llm)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert seen["compressed"] > 0 and seen["narrow_past_bound"] == 0


def test_a_full_pool_preempts_and_every_page_comes_back(folder, ckpt):
    """More requests than both tiers hold: preemption by recompute frees pages of both tiers
    (a recomputed request is prefilled into narrow pages again), every request finishes,
    and no page is left in use."""
    llm = _llm(folder, ckpt)
    seen = _watch(llm)
    outs = llm.generate([_ids(300, 10 + s) for s in range(8)], _greedy(150))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 150 for o in outs)
    assert sum(o.metrics["preemptions"] for o in outs) > 0
    assert seen["compressed"] > 0  # (past the wide tier's room, pages stay narrow: allowed)
    assert llm.allocator.num_used == 0 and llm.allocator.num_free == llm.allocator.num_pages
