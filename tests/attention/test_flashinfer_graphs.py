"""FlashInfer's paged decode inside the engine's decode CUDA graphs (GPU, flashinfer
installed): a graph captured once and replayed over new lengths reads the plan made before
each replay, and the engine's graphed decode picks Triton's tokens. The helpers are the provider
tests', the fixtures in conftest."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.attention.test_flashinfer_provider import BF16, D, HQ, PS, _cache, _ctx, _providers, _view


@pytest.mark.gpu
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_graph_replays_read_the_plan_made_before_each(flashinfer, tensor_cores, monkeypatch):
    """Two layers' decode captured once in a CUDA graph (a decode graph's context), then
    replayed over other lengths, each planned by plan_graph_step just before: every replay
    equals the Triton decode over that replay's lengths; layers whose lengths differ read
    their own plans; a change in which layers agree is a new layout (the engine recaptures).
    The last replay keeps every row's page count and changes the last pages' fill: its plans
    are refreshed without calling FlashInfer's plan, and still read the new lengths."""
    from sparseengine.kernels.testing import assert_close, randn

    gen = torch.Generator().manual_seed(11)
    full = [700, 33, 2048, 5]
    kv = _cache(full, gen)
    q = randn(len(full), HQ, D, generator=gen, dtype=BF16, device="cuda")
    fi, tri = _providers(decode_tensor_cores=tensor_cores)
    graph_id = ("test", len(full))
    views = [_view(kv, [1] * len(full)) for _ in range(2)]  # a graph's views: placeholder host lengths
    ctx = _ctx([1] * len(full), views)
    ctx.graph = graph_id
    steps = [np.array([full, [12, 33, 1500, 4]]), np.array([[650, 1, 1999, 5], [300, 20, 2048, 1]]),
             np.array([[645, 2, 1990, 3], [290, 17, 2040, 16]])]  # the page counts of the step before
    planned, step = [], [0]  # the step of each FlashInfer plan made
    real_plan = flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan
    monkeypatch.setattr(flashinfer.BatchDecodeWithPagedKVCacheWrapper, "plan",
                        lambda self, *a, **k: (planned.append(step[0]), real_plan(self, *a, **k))[1])
    layouts = [fi.plan_graph_step(graph_id, steps[0], kv.page_table, kv.k_cache, HQ)]
    for _ in range(2):  # warm-up outside the capture (as the engine's graphs do)
        [fi.attend(q, kv.k_cache, kv.v_cache, ctx, v, None, None) for v in views]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fi.attend(q, kv.k_cache, kv.v_cache, ctx, v, None, None)[0] for v in views]
    for i, lens in enumerate(steps):
        if i:
            step[0] = i
            layouts.append(fi.plan_graph_step(graph_id, lens, kv.page_table, kv.k_cache, HQ))
        graph.replay()
        for layer, out in enumerate(outs):
            view = _view(kv, lens[layer].tolist())
            ref = tri.attend(q, kv.k_cache, kv.v_cache, _ctx([1] * len(full), [view]), view, None, None)[0]
            assert_close(out, ref, 2e-2, f"replay {i} layer {layer}: flashinfer graph vs triton")
    assert layouts == [(0, 1), (0, 1), (0, 1)]
    assert planned == [0, 0, 1, 1], planned  # two plans for each of the first two steps, none for the third
    same = np.array([full, full])
    assert fi.plan_graph_step(graph_id, same, kv.page_table, kv.k_cache, HQ) == (0, 0)


@pytest.mark.gpu
def test_engine_flashinfer_decode_runs_in_cuda_graphs(flashinfer, tiny_llama_d128):
    """The FlashInfer engine captures its decode steps (no enforce_eager) and replays them
    with each step's lengths planned: requests of different lengths, joining and finishing
    (buckets change), every greedy token FlashInfer's graphs pick is the top token of the
    Triton engine teacher-forced on them, up to bf16 noise; PyramidKV's layers of different
    lengths read their own plans."""
    from sparseengine import LLM, SamplingParams

    folder = tiny_llama_d128
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (150, 70, 33, 260, 9)]
    kw = dict(dtype="bfloat16", device="cuda", page_size=PS, num_kv_pages=512, max_num_batched_tokens=512)
    for method, knobs in (("vanilla", {}), ("pyramidkv", dict(sink_tokens=4, budget=48, recent_tokens=8))):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 12, 30, 6, 20)]
        with LLM(str(folder), attention_provider="flashinfer", sparse_method=method, **knobs, **kw) as llm:
            tokens = [o.token_ids for o in llm.generate(prompts, params)]
            assert llm.runner.graph_steps >= 20, (method, llm.runner.graph_steps)
            plans = max(max(layout) + 1 for layout in llm.provider.graph_layouts().values())
            assert (plans > 1) == (method == "pyramidkv"), (method, llm.provider.graph_layouts())
        with LLM(str(folder), attention_provider="flashinfer", sparse_method=method, enforce_eager=True,
                 **knobs, **kw) as llm:
            eager = [o.token_ids for o in llm.generate(prompts, params)]
        if method == "vanilla":  # teacher-forced on the graphs' picks (eviction changes the cache: not for pyramidkv)
            with LLM(str(folder), attention_provider="triton", enforce_eager=True, **kw) as llm:
                forced = llm.prompt_logits([p + t[:-1] for p, t in zip(prompts, tokens)])
            for p, toks, lg in zip(prompts, tokens, forced):
                rows = lg[len(p) - 1:].float()
                picked = rows[torch.arange(len(toks)), torch.tensor(toks)]
                tol = 0.02 * rows.abs().max().item()
                gap = (rows.max(-1).values - picked).max().item()
                assert gap <= tol, f"graph tokens {toks}: a pick {gap:.4f} below the top (tol {tol:.4f})"
        # against the eager FlashInfer engine (whose decode need not split the cache: bf16 sums
        # in another order, so a near tie may go the other way and the request's tail with it)
        agree = sum(a == b for t, e in zip(tokens, eager) for a, b in zip(t, e)) / sum(map(len, eager))
        assert agree >= 0.75, (method, agree, tokens, eager)
