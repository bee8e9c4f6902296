"""Asynchronous scheduling (the engine reads a step's tokens during the next step) gives
the same requests the same tokens, finish reasons and pages back as reading them in the
step: through batching with arrivals and departures, chunked prefill, preemption by
recompute, seeded sampling, stop tokens and every decode method; on the GPU also through
the decode graphs. And the pieces: which rows a step feeds on the device."""

from __future__ import annotations

import pytest
import torch

from sparseengine import LLM, ConfigError, SamplingParams
from sparseengine.engine.inflight import NEEDS_TOKENS, PLACEHOLDER, Inflight
from sparseengine.engine.scheduler import ScheduledBatch
from sparseengine.engine.sequence import Sequence


def _prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _params(stop_token: int) -> list[SamplingParams]:
    """Greedy of several lengths (rows leave the batch at different steps), seeded
    sampling, and a stop token that the sync run's greedy output contains."""
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 23, 14, 31)] + [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11, max_tokens=19, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)]


def _run(folder, prompts, params, **kw):
    with LLM(folder, dtype="float32", page_size=8, prefill_chunk_size=24, max_num_seqs=4, **kw) as llm:
        outs = llm.generate(prompts, params)
        assert llm._inflight is None and not llm.scheduler.has_unfinished
        assert llm.allocator.num_used == 0  # every page back, the dropped step's included
        return [(o.token_ids, o.finish_reason) for o in outs], sum(o.metrics["preemptions"] for o in outs)


@pytest.mark.parametrize("method", ["vanilla", "snapkv", "streamingllm", "h2o", "quest", "pyramidkv", "omnikv",
                                    "deltakv"])
def test_async_equals_sync(tiny_llama, tiny_method_knobs, method):
    folder, hf = tiny_llama
    prompts = _prompts(hf.config.vocab_size, [40, 9, 61, 33, 50, 17, 26], seed=3)
    knobs = dict(sparse_method=method, sink_tokens=4, recent_tokens=8, budget=16, quest_page_size=8,
                 **tiny_method_knobs)
    probe, _ = _run(str(folder), prompts[5:6], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)],
                    kv_cache_memory=0.01, async_scheduling=False, **knobs)
    greedy = probe[0][0]
    stop = greedy[6]  # prompt 5 stops at the first of its greedy tokens equal to its 7th
    params = _params(stop_token=stop)
    want, _ = _run(str(folder), prompts, params, kv_cache_memory=0.01, async_scheduling=False, **knobs)
    got, _ = _run(str(folder), prompts, params, kv_cache_memory=0.01, async_scheduling=True, **knobs)
    assert got == want
    assert want[5] == (greedy[:greedy.index(stop) + 1], "stop")
    assert PLACEHOLDER not in sum((ids for ids, _ in got), [])


def test_async_equals_sync_under_preemption(tiny_llama):
    folder, hf = tiny_llama
    prompts = _prompts(hf.config.vocab_size, [40, 60, 50, 30, 45, 55], seed=7)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 33, 40, 21, 40, 37)]
    want, _ = _run(str(folder), prompts, params, num_kv_pages=30, async_scheduling=False)
    got, preemptions = _run(str(folder), prompts, params, num_kv_pages=30, async_scheduling=True)
    assert preemptions > 0 and got == want


def test_step_leaves_a_placeholder_until_the_next_step(tiny_llama):
    """A step's sampled token is read during the next step; ``generate`` drains it."""
    folder, hf = tiny_llama
    prompt = _prompts(hf.config.vocab_size, [12], seed=1)[0]
    with LLM(str(folder), dtype="float32", page_size=8, async_scheduling=True) as llm:
        seq = Sequence(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       llm.model_config.num_layers)
        llm.scheduler.add(seq)
        llm.step()  # the prefill samples the first token
        assert seq.output_token_ids == [PLACEHOLDER]
        llm.step()  # the first token is read while the second step runs
        first = seq.output_token_ids[0]
        assert first != PLACEHOLDER and seq.output_token_ids[1:] == [PLACEHOLDER]
        llm.step()  # the third token: the request reaches max_tokens and leaves the schedule at once
        assert seq.finish_reason == "length" and not llm.scheduler.has_unfinished
        assert seq.output_token_ids[-1] == PLACEHOLDER and llm.sync() == 1 and llm.sync() == 0
        assert len(seq.output_token_ids) == 3 and PLACEHOLDER not in seq.output_token_ids
        again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
        assert again.token_ids == seq.output_token_ids and again.token_ids[0] == first


def test_async_scheduling_must_be_a_bool(tiny_llama):
    with pytest.raises(ConfigError, match="async_scheduling='yes'"):
        LLM(str(tiny_llama[0]), async_scheduling="yes")


def _seq(prompt_len: int, outputs: int, computed: int) -> Sequence:
    seq = Sequence(list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=50), num_layers=2)
    seq.output_token_ids = [7] * (outputs - 1) + [PLACEHOLDER]
    seq.num_computed_tokens = computed
    return seq


def test_feed_rows():
    """Decode rows whose input is in flight are fed; a chunk holding the in-flight token
    needs the tokens on the host first; other rows are left alone."""
    a, b, c = _seq(10, 2, 11), _seq(5, 1, 5), _seq(8, 3, 10)  # each decodes its placeholder
    other = _seq(6, 1, 6)
    tokens = torch.tensor([101, 102, 103])
    inflight = Inflight([a, b, c], [0, 1, 2], tokens)
    assert inflight.feed(ScheduledBatch([other], [1])) is None  # not in flight
    feed = inflight.feed(ScheduledBatch([c, other, a], [1, 1, 1]))
    assert (feed.rows, feed.src) == ([0, 2], [2, 0])
    ids = torch.tensor([PLACEHOLDER, 55, PLACEHOLDER])
    feed.apply(ids)
    assert ids.tolist() == [103, 55, 101]
    chunk = _seq(9, 1, 2)  # a prefill chunk before a decode row: rows count tokens
    assert inflight.feed(ScheduledBatch([chunk, a], [3, 1])).rows == [3]
    same = inflight.feed(ScheduledBatch([a, b, c], [1, 1, 1]))  # the same batch again: one copy
    ids = torch.full((3,), PLACEHOLDER)
    same.apply(ids)
    assert ids.tolist() == [101, 102, 103]
    b.num_computed_tokens = 0  # preempted, prefilled again: its chunk reaches the placeholder
    assert inflight.feed(ScheduledBatch([a, b], [1, 6])) == NEEDS_TOKENS
    assert inflight.feed(ScheduledBatch([a, b], [1, 5])) is not None  # a chunk short of it: no
    assert inflight.read() == [101, 102, 103]
    assert (a.output_token_ids[-1], b.output_token_ids[-1], c.output_token_ids[-1]) == (101, 102, 103)
    assert inflight.feed(ScheduledBatch([a], [1])) is None  # read: the ids are on the host


@pytest.mark.gpu
def test_async_equals_sync_on_gpu_graphs(tiny_llama):
    """Through the decode graphs (bf16, the Triton provider): the same tokens, and graph
    steps with fed rows ran (rows leave the batch at different steps: fed by index)."""
    folder, hf = tiny_llama
    prompts = _prompts(hf.config.vocab_size, [40, 9, 61, 33, 50, 17, 26], seed=3)
    params = _params(stop_token=5)
    results = []
    for flag in (False, True):
        with LLM(str(folder), device="cuda", dtype="bfloat16", page_size=16, max_num_seqs=4,
                 async_scheduling=flag) as llm:
            outs = llm.generate(prompts, params)
            assert llm.runner.graph_steps > 0
            results.append([(o.token_ids, o.finish_reason) for o in outs])
    assert results[0] == results[1]

