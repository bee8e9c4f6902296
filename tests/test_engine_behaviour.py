"""Batching, chunking, preemption, bad input and lifetime behaviour of the engine."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from sparseengine import LLM, ConfigError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    folder, hf = tiny_llama
    return str(folder), hf.config.vocab_size


def test_chunked_prefill_gives_same_logits(smollm2_folder):
    ids = random_prompts(49152, [300, 97], seed=3)
    results = []
    for chunk in (16, 64, 4096):
        with LLM(str(smollm2_folder), dtype="float32", prefill_chunk_size=chunk, page_size=16,
                 kv_cache_memory=0.05) as llm:
            results.append(llm.prompt_logits(ids))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert float((a - b).norm() / b.norm()) < 1e-5


def test_prompt_logits_of_the_last_positions(tiny):
    """``last=k`` gives the last k rows of the full logits (k past the prompt: all of them),
    across prefill chunks; a bad ``last`` raises."""
    folder, vocab = tiny
    ids = random_prompts(vocab, [70, 9], seed=11)
    with LLM(folder, dtype="float32", page_size=8, kv_cache_memory=0.01, prefill_chunk_size=32) as llm:
        full = llm.prompt_logits(ids)
        for last in (1, 5, 40, 70, 200):
            got = llm.prompt_logits(ids, last=last)
            for f, g in zip(full, got):
                assert g.shape == (min(last, f.shape[0]), vocab)
                torch.testing.assert_close(g, f[-g.shape[0]:], rtol=1e-5, atol=1e-5)
        for bad in (0, -3, 2.5, True):
            with pytest.raises(ConfigError, match="Invalid last="):
                llm.prompt_logits(ids, last=bad)


def test_bf16_logits_reach_the_sampler_as_computed(tiny):
    """A bf16 model's LM head output goes to the sampler in bf16 (no float32 copy a step);
    ``prompt_logits`` still hands back float32 rows, holding bf16 values, and greedy decoding
    takes each row's argmax: the first new token is the last prompt row's argmax."""
    folder, vocab = tiny
    ids = random_prompts(vocab, [21, 13], seed=5)
    with LLM(folder, dtype="bfloat16", page_size=8, kv_cache_memory=0.01) as llm:
        logits = llm.prompt_logits(ids)
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    for rows, out in zip(logits, outs):
        assert rows.dtype == torch.float32 and torch.equal(rows, rows.bfloat16().float())
        assert out.token_ids == [int(rows[-1].argmax())]


def test_alone_equals_inside_batch_of_8(tiny):
    folder, vocab = tiny
    prompts = random_prompts(vocab, [9, 33, 70, 4, 51, 18, 64, 27], seed=5)
    with LLM(folder, dtype="float32", page_size=8, kv_cache_memory=0.01, prefill_chunk_size=32) as llm:
        batch = llm.generate(prompts, GREEDY)
        for prompt, out in zip(prompts, batch):
            assert llm.generate([prompt], GREEDY)[0].token_ids == out.token_ids


def test_small_pool_forces_preemption_and_keeps_outputs(tiny):
    folder, vocab = tiny
    prompts = random_prompts(vocab, [40, 60, 50, 30, 45, 55], seed=7)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(folder, dtype="float32", page_size=8, kv_cache_memory=0.01) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    # 6 requests need up to 6 * 13 pages; 30 pages force preemption by recompute.
    with LLM(folder, dtype="float32", page_size=8, num_kv_pages=30) as llm:
        outs = llm.generate(prompts, params)
        assert sum(o.metrics["preemptions"] for o in outs) > 0
        assert [o.token_ids for o in outs] == expected
        assert llm.allocator.num_used == 0  # every page returned


def test_bad_requests_fail_alone(tiny):
    folder, vocab = tiny
    good = random_prompts(vocab, [10, 20], seed=9)
    with LLM(folder, dtype="float32", max_model_len=64, page_size=8, kv_cache_memory=0.01) as llm:
        outs = llm.generate([good[0], [], list(range(3, 103)), good[1]], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "empty prompt" in outs[1].error
    assert "longer than max_model_len=64" in outs[2].error and "100 tokens" in outs[2].error
    assert len(outs[0].token_ids) == 12 and len(outs[3].token_ids) == 12


def test_config_errors_name_the_bad_value(tiny):
    folder, _ = tiny
    with pytest.raises(ConfigError, match=r"Unknown config key 'page_sise'.*'page_size'"):
        LLM(folder, page_sise=16)
    with pytest.raises(ConfigError, match=r"page_size=12.*power of two"):
        LLM(folder, page_size=12)
    with pytest.raises(ConfigError, match=r"page_size=0"):
        LLM(folder, page_size=0)
    with pytest.raises(ConfigError, match=r"Unknown sparse_method='snapkvv'"):
        LLM(folder, sparse_method="snapkvv")
    with pytest.raises(ConfigError, match=r"max_tokens=-1"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ConfigError, match=r"Unknown model='no/such/model'"):
        LLM("no/such/model")
    with pytest.raises(ConfigError, match=r"load_format='dummy'"):
        LLM("tiny-llama")


def test_seeded_sampling_is_reproducible(tiny):
    folder, vocab = tiny
    prompts = random_prompts(vocab, [12, 30], seed=11)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    with LLM(folder, dtype="float32", page_size=8, kv_cache_memory=0.01) as llm:
        a = [o.token_ids for o in llm.generate(prompts, params)]
        b = [o.token_ids for o in llm.generate(prompts, params)]
        c = [o.token_ids for o in llm.generate(prompts, SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, seed=99, ignore_eos=True))]
    assert a == b
    assert a != c


def test_top_k_one_is_greedy(tiny):
    folder, vocab = tiny
    prompts = random_prompts(vocab, [25], seed=13)
    with LLM(folder, dtype="float32", page_size=8, kv_cache_memory=0.01) as llm:
        greedy = llm.generate(prompts, GREEDY)[0].token_ids
        sampled = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=12,
                                                       ignore_eos=True, seed=3))[0].token_ids
    assert sampled == greedy


def test_stop_token_ids_and_max_tokens(tiny):
    folder, vocab = tiny
    prompt = random_prompts(vocab, [25], seed=13)[0]
    with LLM(folder, dtype="float32", page_size=8, kv_cache_memory=0.01) as llm:
        full = llm.generate([prompt], GREEDY)[0].token_ids
        stop_at = full[5]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                    stop_token_ids=[stop_at]))[0]
        assert out.finish_reason == "stop" and out.token_ids == full[: full.index(stop_at) + 1]
        assert llm.generate([prompt], SamplingParams(max_tokens=0))[0].token_ids == []


def test_two_engines_in_one_process_and_close(tiny):
    folder, vocab = tiny
    threads = threading.active_count()
    prompts = random_prompts(vocab, [20], seed=17)
    first = LLM(folder, dtype="float32", page_size=8, kv_cache_memory=0.01)
    a = first.generate(prompts, GREEDY)[0].token_ids
    first.close()
    with pytest.raises(RuntimeError, match="closed"):
        first.generate(prompts, GREEDY)
    with LLM(folder, dtype="float32", page_size=8, kv_cache_memory=0.01) as second:
        assert second.generate(prompts, GREEDY)[0].token_ids == a
    gc.collect()
    assert threading.active_count() <= threads
    assert not hasattr(second, "kv_cache") and not hasattr(second, "model")
