"""``LLM.teacher_forced``: prefill, then decode feeding given tokens through the method's
own decode path; the logits at each step and, when asked, every layer's attention output.

The reference here is the engine's prefill (``prompt_logits`` of prompt + continuation),
a different code path from decode: in float32 the two agree to about 1e-6 relative (the
attention and matmul reductions run in different orders); the tests allow 1e-4 relative
(and 1e-3 absolute on logits of magnitude ~10), a hundred times that, and still far below
what one wrong fed token or a sparse selection changes (0.1 and more)."""

from __future__ import annotations

import pytest
import torch

from sparseengine import LLM, ConfigError, SamplingParams
from sparseengine.engine.teacher_forcing import TeacherForcedOutput

SMOL = dict(dtype="float32", device="cpu", kv_cache_memory=0.05, page_size=16)
N = 10  # continuation tokens


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def prompts(smollm2_folder) -> list[list[int]]:
    """Natural text: two prompts of different lengths (so a batch mixes them)."""
    from experiments.corpus import token_windows
    from sparseengine.models import loader

    tok = loader.load_tokenizer(loader.resolve(str(smollm2_folder), "auto"))
    a, b = token_windows(tok, 49152, 192, 2, seed=0)
    return [a, b[:131]]


@pytest.fixture(scope="module")
def dense(smollm2_folder, prompts):
    """The vanilla engine, its greedy continuations and their teacher-forced outputs."""
    with LLM(str(smollm2_folder), **SMOL) as llm:
        greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N,
                                                                             ignore_eos=True))]
        forced = llm.teacher_forced(prompts, greedy, capture_attention=True)
        yield llm, greedy, forced


def _prefill_rows(llm: LLM, prompt: list[int], cont: list[int]) -> torch.Tensor:
    """prompt_logits' rows predicting each continuation token."""
    return llm.prompt_logits([prompt + cont])[0][len(prompt) - 1: len(prompt) + len(cont) - 1]


def test_vanilla_along_its_greedy_continuation(dense, prompts, smollm2_folder):
    llm, greedy, forced = dense
    cfg = llm.model_config
    for prompt, cont, out in zip(prompts, greedy, forced):
        assert isinstance(out, TeacherForcedOutput) and out.continuation == cont and out.preemptions == 0
        assert out.logits.shape == (N, cfg.vocab_size) and out.logits.dtype == torch.float32
        assert out.attention.shape == (N, cfg.num_layers, cfg.num_heads * cfg.head_dim)
        assert out.attention.dtype == torch.float32 and out.attention.device.type == "cpu"
        assert out.logits.argmax(-1).tolist() == cont  # generate's greedy tokens
        ref = _prefill_rows(llm, prompt, cont)
        assert rel_err(out.logits, ref) < 1e-4 and float((out.logits - ref).abs().max()) < 1e-3
    again = llm.teacher_forced(prompts, greedy)
    assert all(a.attention is None and torch.equal(a.logits, b.logits) for a, b in zip(again, forced))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_forced_tokens_are_fed(dense, prompts, smollm2_folder, async_scheduling):
    """A continuation that is not the greedy one: each row after the first depends on the
    forced tokens (equal to the prefill of prompt + forced), not on what the model would
    have sampled; with asynchronous scheduling too (tokens settle a step late)."""
    _, greedy, dense_forced = dense
    forced_conts = _prompts(49152, [N, N], seed=9)
    with LLM(str(smollm2_folder), async_scheduling=async_scheduling, **SMOL) as llm:
        assert llm.async_scheduling is async_scheduling
        outs = llm.teacher_forced(prompts, forced_conts)
        assert llm._inflight is None and llm.allocator.num_used == 0
        for prompt, cont, out, along_greedy in zip(prompts, forced_conts, outs, dense_forced):
            assert out.logits.argmax(-1).tolist() != cont
            assert rel_err(out.logits, _prefill_rows(llm, prompt, cont)) < 1e-4
            assert rel_err(out.logits[0], along_greedy.logits[0]) < 1e-5  # the same prompt
            assert rel_err(out.logits[1:], along_greedy.logits[1:]) > 0.05  # different tokens fed


@pytest.mark.parametrize("method,knobs", [("quest", dict(quest_page_size=16, quest_skip_layers=2)),
                                          ("streamingllm", {})])
def test_decode_side_method_differs_from_dense(dense, prompts, smollm2_folder, method, knobs):
    """Total budget 4 + 32 + 16 = 52 tokens, well below the prompts (131 and 192): the
    decode rows differ from vanilla's, in logits and attention outputs; the first row (the
    prompt's last position, a dense prefill for both) does not."""
    _, greedy, ref = dense
    with LLM(str(smollm2_folder), sparse_method=method, sink_tokens=4, budget=32, recent_tokens=16, **SMOL,
             **knobs) as llm:
        outs = llm.teacher_forced(prompts, greedy, capture_attention=True)
    for got, want in zip(outs, ref):
        assert got.attention.shape == want.attention.shape
        err = (got.attention - want.attention).norm(dim=-1) / want.attention.norm(dim=-1)  # [rows, layers]
        logp, ref_logp = torch.log_softmax(got.logits, -1), torch.log_softmax(want.logits, -1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        assert float(err[0].max()) < 1e-4 and float(kl[0].abs()) < 1e-4
        assert float(err[1:].mean()) > 0.01 and float(kl[1:].mean()) > 1e-3, (float(err[1:].mean()),
                                                                              float(kl[1:].mean()))


def test_vanilla_against_itself_is_exact(dense, prompts, smollm2_folder):
    """A second vanilla engine, with another chunk size and batched differently, gives the
    same attention outputs (relative error ~1e-6 at most) and logits."""
    _, greedy, ref = dense
    with LLM(str(smollm2_folder), prefill_chunk_size=64, max_num_seqs=1, **SMOL) as llm:
        outs = llm.teacher_forced(prompts, greedy, capture_attention=True)
    for got, want in zip(outs, ref):
        err = (got.attention - want.attention).norm(dim=-1) / want.attention.norm(dim=-1)
        assert float(err.max()) < 1e-5 and rel_err(got.logits, want.logits) < 1e-5


def test_bad_input_raises_config_error(dense, prompts):
    llm, greedy, _ = dense
    vocab = llm.model_config.vocab_size
    cases = [
        ((prompts, greedy[:1]), r"2 prompts but 1 continuations"),
        ((prompts, [greedy[0], []]), r"continuation 1 is empty"),
        ((prompts, [greedy[0], [5, vocab]]), rf"continuation 1 holds token id {vocab}, outside .*\[0, {vocab}\)"),
        ((prompts, [greedy[0], [-1]]), r"continuation 1 holds token id -1"),
        (([prompts[0] + [vocab + 7]], greedy[:1]), rf"prompt 0 holds token id {vocab + 7}"),
        (([[]], greedy[:1]), r"request 0: empty prompt"),
        (([prompts[0]], [[1] * (llm.max_model_len - len(prompts[0]) + 1)]), r"request 0: .* max_model_len"),
        ((prompts[0], greedy[0]), r"a list of prompts"),
    ]
    for args, match in cases:
        with pytest.raises(ConfigError, match=match):
            llm.teacher_forced(*args)
        assert not llm.scheduler.has_unfinished  # nothing was queued
    pages = llm.allocator.num_pages
    with pytest.raises(ConfigError, match=rf"request 0 needs {pages + 1} KV pages but the pool holds {pages}"):
        llm.teacher_forced([[7] * (pages * 16 - 4)], [[7] * 20])


def test_preemption_keeps_forced_rows(tiny_llama):
    """A pool too small for the batch: requests are preempted and prefilled again over
    prompt + the continuation so far, and every row still predicts from the forced tokens."""
    folder, hf = tiny_llama
    prompts = _prompts(hf.config.vocab_size, [40, 60, 50, 30], seed=7)
    conts = _prompts(hf.config.vocab_size, [30, 30, 30, 30], seed=8)
    with LLM(str(folder), dtype="float32", page_size=8, num_kv_pages=24) as llm:
        outs = llm.teacher_forced(prompts, conts)
        assert sum(o.preemptions for o in outs) > 0 and llm.allocator.num_used == 0
        for prompt, cont, out in zip(prompts, conts, outs):
            assert rel_err(out.logits, _prefill_rows(llm, prompt, cont)) < 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for decode graphs with the Triton kernels "
                    "interpreted, which tests/conftest.py sets only on a machine without CUDA")
def test_decode_graphs_replay_unless_capturing(tiny_llama):
    """With decode graphs (on the CPU each capture a ``Rerun``, the Triton provider
    interpreted): with a capture every step runs eagerly (no graph step); without one the
    decode steps replay the graphs, and give the eager steps' logits (each step's row copied
    out of the graph's logits buffer before the next replay rewrites it)."""
    from sparseengine.engine.cuda_graphs import DecodeGraphs, table_pages

    folder, hf = tiny_llama
    prompts = _prompts(hf.config.vocab_size, [40, 29], seed=4)
    conts = _prompts(hf.config.vocab_size, [4, 4], seed=5)
    with LLM(str(folder), attention_provider="triton", sparse_method="quest", quest_page_size=8, page_size=8,
             sink_tokens=4, budget=16, recent_tokens=8, num_kv_pages=32, max_model_len=64, dtype="float32") as llm:
        llm.runner.graphs = DecodeGraphs(llm.model, llm.kv_cache, llm.provider, llm.method, llm.device,
                                         max_batch=2, max_pages=table_pages(llm.method, 64, 8))
        eager = llm.teacher_forced(prompts, conts, capture_attention=True)
        assert llm.runner.graph_steps == 0
        replayed = llm.teacher_forced(prompts, conts)
        assert llm.runner.graph_steps == 3  # every step after the prefill
    for e, r in zip(eager, replayed):
        assert e.attention.shape == (4, hf.config.num_hidden_layers, hf.config.hidden_size)
        assert rel_err(r.logits, e.logits) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["vanilla", "quest"])
def test_on_gpu_with_graphs_and_async_scheduling(tiny_llama, method):
    """On a GPU (CUDA decode graphs and asynchronous scheduling on by default): forcing the
    greedy continuation gives generate's tokens as each row's argmax, with the graphs
    replayed; with a capture every step runs eagerly, and the eager rows agree with the
    replayed ones; a non-greedy continuation is what gets fed (its rows equal the prefill
    of prompt + continuation)."""
    folder, hf = tiny_llama
    prompts = _prompts(hf.config.vocab_size, [40, 29, 57], seed=6)
    knobs = dict(quest_page_size=8, sink_tokens=4, budget=16, recent_tokens=8) if method == "quest" else {}
    with LLM(str(folder), device="cuda", dtype="float32", page_size=8, num_kv_pages=256, max_model_len=96,
             sparse_method=method, **knobs) as llm:
        assert llm.async_scheduling and llm.runner.graphs is not None
        greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True))]
        steps = llm.runner.graph_steps
        replayed = llm.teacher_forced(prompts, greedy)
        assert llm.runner.graph_steps > steps
        assert [o.logits.argmax(-1).tolist() for o in replayed] == greedy
        steps = llm.runner.graph_steps
        eager = llm.teacher_forced(prompts, greedy, capture_attention=True)
        assert llm.runner.graph_steps == steps
        for e, r in zip(eager, replayed):
            assert e.attention.shape == (8, hf.config.num_hidden_layers, hf.config.hidden_size)
            assert rel_err(r.logits, e.logits) < 1e-4
        if method == "vanilla":
            conts = _prompts(hf.config.vocab_size, [8, 8, 8], seed=7)
            for prompt, cont, out in zip(prompts, conts, llm.teacher_forced(prompts, conts)):
                assert rel_err(out.logits, _prefill_rows(llm, prompt, cont)) < 1e-4
