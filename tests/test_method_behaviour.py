"""Sparse methods inside the engine: what they keep shows in what the model can recall,
in the pool, and in which combinations are allowed."""

from __future__ import annotations

import itertools

import pytest
import torch

from sparseengine import LLM, ConfigError, SamplingParams
from sparseengine.method_registry import PREFILL_POLICIES, decode_methods, get_spec, prefill_methods

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEYS = (68241, 13579, 90210, 45126)


def passkey_prompt(tok, n_tokens: int, depth: float, key: int) -> list[int]:
    filler = tok.encode(FILLER, add_special_tokens=False)
    body = filler * (n_tokens // len(filler) + 2)
    needle = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False)
    question = tok.encode(" What is the pass key? The pass key is", add_special_tokens=False)
    room = n_tokens - len(needle) - len(question)
    at = int(room * depth)
    return body[:at] + needle + body[at:room] + question


def found(llm, prompts) -> list[bool]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=7))
    return [str(key) in o.text for key, o in zip(KEYS, outs)]


@pytest.mark.slow
def test_passkey_streaming_loses_it_quest_finds_it(smollm2_folder, smollm2):
    """2K-token prompts, needle at 50% depth, 512 attended tokens (16 sink, 64 recent, 432
    budget). The needle sits in StreamingLLM's evicted middle; Quest's page bound finds it.
    Measured on this prompt set: vanilla 4/4, quest 3/4 (the miss transposes two digits),
    streamingllm 0/4 (see results/cpu_methods_smollm2.csv for the other methods).

    Why Quest misses one (scripts/quest_passkey_probe.py -> results/quest_passkey_probe.csv):
    the upper bound U is loose, so in the last layers (25-29, where the copying happens)
    filler pages outrank the needle's: its digit tokens are covered in 0-44% of (head, step)
    there, against 44-100% when the same number of pages is ranked by the exact per-page
    max q.k. With that exact ranking all 4 keys are found, and so they are with Quest at
    twice the budget: the bound's slack at this budget, not a selection bug."""
    prompts = [passkey_prompt(smollm2.tokenizer, 2048, 0.5, key) for key in KEYS]
    assert all(found(smollm2, prompts))
    budget = dict(sink_tokens=16, recent_tokens=64, budget=432)
    with LLM(str(smollm2_folder), dtype="float32", sparse_method="streamingllm", **budget) as llm:
        assert not any(found(llm, prompts))
    with LLM(str(smollm2_folder), dtype="float32", sparse_method="quest", **budget) as llm:
        assert sum(found(llm, prompts)) >= 3


def max_concurrency(llm, prompts, params) -> int:
    """The most requests decoding together: each holds its whole (kept) cache."""
    peak, step = 0, llm.step

    def counted():
        nonlocal peak
        peak = max(peak, sum(s.is_decoding for s in llm.scheduler.running))
        return step()

    llm.step = counted
    try:
        outs = llm.generate(prompts, params)
    finally:
        del llm.step
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.allocator.peak_used <= llm.allocator.num_pages and llm.allocator.num_used == 0
    return peak


def test_eviction_frees_pages_so_more_requests_run(tiny_llama):
    folder, hf = tiny_llama
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, hf.config.vocab_size, (200,), generator=gen).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(dtype="float32", page_size=8, num_kv_pages=90, prefill_chunk_size=64,
                  sink_tokens=4, budget=24, recent_tokens=12, snapkv_window=4)
    with LLM(str(folder), sparse_method="vanilla", **common) as llm:
        dense = max_concurrency(llm, prompts, params)
    with LLM(str(folder), sparse_method="snapkv", **common) as llm:
        sparse = max_concurrency(llm, prompts, params)
    assert dense <= 3  # 90 pages of 8 hold three 200+24-token requests
    assert sparse > dense


def _expect(decode: str, prefill: str, policy: str) -> str | None:
    """The ConfigError text expected for a combination, from the registry alone."""
    spec, pre = get_spec(decode), get_spec(prefill, "prefill")
    if policy != "auto" and policy != spec.prefill_policy:
        return "disagrees with the registry default"
    if pre.combines_with != ("*",) and decode not in pre.combines_with:
        return f"prefill_sparse_method={prefill!r} does not combine with sparse_method={decode!r}"
    return None


@pytest.mark.parametrize("decode,prefill,policy", list(itertools.product(
    decode_methods(), prefill_methods(), ("auto",) + PREFILL_POLICIES)))
def test_combination_matrix(tiny_llama, tiny_method_knobs, decode, prefill, policy):
    folder, hf = tiny_llama
    knobs = dict(sparse_method=decode, prefill_sparse_method=prefill, prefill_policy=policy,
                 dtype="float32", page_size=8, kv_cache_memory=0.01, sink_tokens=2, budget=8, recent_tokens=4,
                 quest_page_size=8, **tiny_method_knobs)
    expected = _expect(decode, prefill, policy)
    if expected is not None:
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            LLM(str(folder), **knobs)
        return
    prompt = torch.randint(3, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with LLM(str(folder), **knobs) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize("method,n", [("snapkv", 20), ("snapkv", 60), ("pyramidkv", 20), ("pyramidkv", 70),
                                      ("h2o", 12), ("h2o", 60), ("streamingllm", 50)])
def test_rows_stay_within_max_cache_tokens(tiny_llama, method, n):
    """The bound the synthesized benchmarks size the pool by (``max_cache_tokens``: the
    most a row holds while generating) holds at every decode step, read when the step's
    token is in and nothing is evicted yet, for short prompts that grow past the total too."""
    from sparseengine.engine.sequence import Sequence

    out, peak = 40, []
    with LLM(str(tiny_llama[0]), device="cpu", dtype="float32", sparse_method=method, sink_tokens=4, budget=16,
             recent_tokens=8, snapkv_window=8, snapkv_decode_eviction=True, snapkv_decode_interval=6,
             h2o_decode_interval=5, page_size=8, kv_cache_memory=0.01) as llm:
        finish = llm.method.finish_step

        def before_evictions(batch):  # the engine's own hook, called as it would be
            peak.extend(max(s.layer_lens) for s in llm.method.decoding)  # this step's decode rows
            return finish(batch)

        llm.method.finish_step = before_evictions
        seq = Sequence(list(range(3, 3 + n)), SamplingParams(temperature=0, max_tokens=out, ignore_eos=True),
                       llm.model_config.num_layers)
        llm.scheduler.add(seq)
        while seq.finish_reason is None:
            llm.step()
        bound = llm.method.max_cache_tokens(n, out)
    assert seq.finish_reason == "length" and len(peak) >= out - 1 and max(peak) <= bound, (max(peak), bound)
