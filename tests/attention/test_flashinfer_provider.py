"""The FlashInfer provider: a clear ConfigError wherever it cannot run (CPU tests), the ops
each provider records, and on a GPU with flashinfer installed: the same attention as the
Triton provider and the fp32 reference (paged decode, chunked mixed-batch prefill, the
Triton-delegated ops) and the same engine results in bf16 (FlashInfer has no fp32)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from sparseengine.attention.provider import OPS, make_provider
from sparseengine.config import ConfigError
from sparseengine.engine.step_context import LayerView, ScoreRows, Selection, StepContext

PIP = "pip install flashinfer-python==0.7.2.post1"


# ---- CPU ----------------------------------------------------------------------------------
def test_flashinfer_on_cpu_is_a_config_error_naming_the_fix():
    with pytest.raises(ConfigError, match="CUDA") as e:
        make_provider("flashinfer", torch.device("cpu"))
    assert PIP in str(e.value)


def test_flashinfer_without_the_package_is_a_config_error_naming_the_fix(monkeypatch):
    from sparseengine.attention.flashinfer_provider import FlashInferAttentionProvider

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # any import of it now fails
    with pytest.raises(ConfigError, match="needs the flashinfer package") as e:
        FlashInferAttentionProvider(torch.device("cuda"))  # constructing a device needs no GPU
    assert PIP in str(e.value)


def test_engine_with_flashinfer_on_cpu_fails_at_construction(tiny_llama):
    from sparseengine import LLM

    folder, _ = tiny_llama
    with pytest.raises(ConfigError, match="flashinfer"):
        LLM(str(folder), attention_provider="flashinfer", device="cpu", dtype="float32", kv_cache_memory=0.01)


def test_auto_never_picks_flashinfer():
    assert make_provider("auto", torch.device("cpu")).name == "torch"
    assert make_provider("auto", torch.device("cuda")).name == "triton"  # constructing it needs no GPU


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_ops_name_the_provider_for_every_op(name):
    from sparseengine.attention.triton_provider import sparse_decode_impl

    provider = make_provider(name, torch.device("cuda" if name == "triton" else "cpu"))
    want = {op: name for op in OPS}
    if name == "triton":  # the CUDA attention takes the sparse decode where it runs (on the CPU: "triton")
        want["sparse_decode"] = sparse_decode_impl()
    assert provider.ops() == want


def test_paged_metadata_lists_each_requests_pages():
    from sparseengine.attention.flashinfer_provider import paged_metadata
    from sparseengine.attention.torch_ref import token_slots

    ps, lens = 4, (1, 4, 5, 13)
    table = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:24].int().view(4, 6)
    view = LayerView(torch.zeros(4, dtype=torch.long), torch.tensor(lens, dtype=torch.int32), lens, table)
    indptr, indices, last = paged_metadata(view, ps)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.tolist() == [0, 1, 2, 4, 8] and last.tolist() == [1, 4, 1, 1]
    for b, n in enumerate(lens):  # FlashInfer's token t of request b: page indices[indptr[b] + t // ps]
        pages = indices[indptr[b]:indptr[b + 1]].long()
        t = torch.arange(n)
        assert torch.equal(pages[t // ps] * ps + t % ps, token_slots(table[b], n, ps))


# ---- GPU ----------------------------------------------------------------------------------
HQ, HKV, D, PS = 32, 8, 128, 16  # Llama-3.1-8B's attention shape; the JIT builds d=128 bf16 only
BF16 = torch.bfloat16


def _cache(lens, gen, page_size=PS, hkv=HKV):
    from sparseengine.kernels.testing import random_paged_kv

    return random_paged_kv(lens, hkv, D, page_size, generator=gen, dtype=BF16, device="cuda", poison=False)


def _view(kv, lens=None):
    lens = [int(n) for n in kv.kv_lens.tolist()] if lens is None else lens
    return LayerView(torch.zeros(len(lens), dtype=torch.long, device="cuda"),
                     torch.tensor(lens, dtype=torch.int32, device="cuda"), tuple(lens), kv.page_table)


def _ctx(q_lens, views):
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device="cuda")
    return StepContext(seqs=[None] * len(q_lens), q_lens=tuple(q_lens), cu_q_lens=cu,
                       is_decode=all(n == 1 for n in q_lens), views=views, kv_cache=None, provider=None,
                       method=None, positions=None)


def _providers(**kw):
    from sparseengine.attention.flashinfer_provider import FlashInferAttentionProvider
    from sparseengine.attention.triton_provider import TritonAttentionProvider

    return FlashInferAttentionProvider(torch.device("cuda"), **kw), TritonAttentionProvider()


@pytest.mark.gpu
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_cores", "tensor_cores"])
@pytest.mark.parametrize("hq,page_size", [(HQ, PS), (16, 8)], ids=["gqa4-ps16", "gqa2-ps8"])
def test_decode_matches_triton_and_reference(flashinfer, tensor_cores, hq, page_size):
    from sparseengine.kernels import paged_decode_ref
    from sparseengine.kernels.testing import assert_close, randn

    gen = torch.Generator().manual_seed(1)
    lens = [1, 15, 16, 17, 300, 4099]
    kv = _cache(lens, gen, page_size)
    q = randn(len(lens), hq, D, generator=gen, dtype=BF16, device="cuda")
    fi, tri = _providers(decode_tensor_cores=tensor_cores)
    view = _view(kv)
    ctx = _ctx([1] * len(lens), [view])
    out, scores = fi.attend(q, kv.k_cache, kv.v_cache, ctx, view, None, None)
    assert scores is None and out.dtype == BF16 and out.shape == q.shape
    ref = paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    assert_close(out, ref, 2e-2, "flashinfer vs reference")
    assert_close(out, tri.attend(q, kv.k_cache, kv.v_cache, ctx, view, None, None)[0], 2e-2, "flashinfer vs triton")
    assert fi.ops()["decode"] == "flashinfer" and fi.ops()["sparse_decode"] == tri.ops()["sparse_decode"]


@pytest.mark.gpu
def test_one_plan_per_view_per_step(flashinfer):
    """Layers that share a view share a plan; a second view in the same step gets its own."""
    from sparseengine.kernels.testing import assert_close, randn

    gen = torch.Generator().manual_seed(2)
    lens = [40, 513, 77]
    kv = _cache(lens, gen)
    short = _view(kv, [n - 9 for n in lens])  # e.g. a layer that evicted tokens
    full = _view(kv)
    q = randn(len(lens), HQ, D, generator=gen, dtype=BF16, device="cuda")
    fi, tri = _providers()
    for step in range(2):
        ctx = _ctx([1] * len(lens), [full, short, full])
        for view in ctx.views:
            expected = tri.attend(q, kv.k_cache, kv.v_cache, ctx, view, None, None)[0]
            assert_close(fi.attend(q, kv.k_cache, kv.v_cache, ctx, view, None, None)[0], expected, 2e-2,
                         f"step {step}")
        assert len(fi._plans) == 2 and sum(len(w) for w in fi._wrappers.values()) == 2  # reused next step


@pytest.mark.gpu
def test_mixed_prefill_matches_triton_and_reference(flashinfer):
    """Decode rows and prefill chunks that continue earlier chunks, in one batch."""
    from sparseengine.kernels import paged_prefill_ref
    from sparseengine.kernels.testing import assert_close, randn

    gen = torch.Generator().manual_seed(3)
    lens, q_lens = [50, 64, 700, 1000, 17], [1, 64, 1, 300, 17]
    kv = _cache(lens, gen)
    q = randn(sum(q_lens), HQ, D, generator=gen, dtype=BF16, device="cuda")
    fi, tri = _providers()
    view = _view(kv)
    ctx = _ctx(q_lens, [view])
    out, scores = fi.attend(q, kv.k_cache, kv.v_cache, ctx, view, None, None)
    assert scores is None
    ref = paged_prefill_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, ctx.cu_q_lens)
    assert_close(out, ref, 2e-2, "flashinfer vs reference")
    assert_close(out, tri.attend(q, kv.k_cache, kv.v_cache, ctx, view, None, None)[0], 2e-2, "flashinfer vs triton")


@pytest.mark.gpu
def test_delegated_ops_match_triton(flashinfer):
    """Selections and column sums run on Triton (rows FlashInfer computes densely may differ
    by rounding only)."""
    from sparseengine.kernels.testing import assert_close, randn

    gen = torch.Generator().manual_seed(4)
    lens, q_lens = [50, 64, 700, 1000], [1, 64, 1, 300]
    kv = _cache(lens, gen)
    fi, tri = _providers()
    view = _view(kv)
    picks = [torch.randperm(n, generator=gen)[:32].cuda() for n in lens]
    pages = torch.stack([torch.stack([torch.randperm(-(-n // PS), generator=gen)[:3] for _ in range(HKV)])
                         for n in lens]).cuda()  # [B, Hkv, 3] logical pages
    page_selection = Selection(pages, torch.full((4, HKV), 3, dtype=torch.int32, device="cuda"),
                               (False, True, False, False), page_size=PS)
    cases = {
        "decode": ([1] * 4, Selection.from_lists([picks[0], None, picks[2], picks[3]], HKV, "cuda"), None),
        "decode_all_sparse": ([1] * 4, Selection.from_lists(picks, HKV, "cuda"), None),
        "decode_pages": ([1] * 4, page_selection, None),
        "decode_colsum": ([1] * 4, None, ScoreRows((1, 1, 0, 1))),
        "prefill_selection": (q_lens, Selection.from_lists([picks[0], None, picks[2], None], HKV, "cuda"), None),
        "prefill_colsum": (q_lens, None, ScoreRows((0, 8, 0, 32))),
    }
    for name, (rows, selection, score_rows) in cases.items():
        q = randn(sum(rows), HQ, D, generator=gen, dtype=BF16, device="cuda")
        ctx = _ctx(rows, [view])
        out, cs = fi.attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, score_rows)
        out_t, cs_t = tri.attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, score_rows)
        assert_close(out, out_t, 2e-2, name)
        assert (cs is None) == (cs_t is None), name
        for b, (a, e) in enumerate(zip(cs or [], cs_t or [])):
            assert a.shape == (HKV, lens[b]) and a.device == e.device, name
            assert_close(a, e, 1e-3, f"{name} column sums {b}")


@pytest.mark.gpu
@pytest.mark.parametrize("route", [True, False], ids=["routed", "not_routed"])
@pytest.mark.parametrize("pages", [False, True], ids=["tokens", "pages"])
def test_mixed_step_decode_rows_leave_flashinfer_prefill(flashinfer, monkeypatch, route, pages):
    """A mixed step with one-row requests: routed, FlashInfer's prefill is planned over the
    requests with more rows, its decode over the one-row request that reads its whole
    cache, and those that read a selection read only it; one plan of each for the step's
    layers. The output matches the torch provider, routed or not."""
    from sparseengine.attention import triton_provider
    from sparseengine.attention.torch_ref import TorchAttentionProvider
    from sparseengine.kernels.testing import assert_close, randn

    monkeypatch.setattr(triton_provider, "ROUTE_DECODE_ROWS", route)
    planned = []
    for kind, cls in (("prefill", flashinfer.BatchPrefillWithPagedKVCacheWrapper),
                      ("decode", flashinfer.BatchDecodeWithPagedKVCacheWrapper)):
        monkeypatch.setattr(cls, "plan", lambda self, first, *a, _plan=cls.plan, _kind=kind, **k: (
            planned.append((_kind, first.tolist())), _plan(self, first, *a, **k))[1])
    gen = torch.Generator().manual_seed(5)
    lens, q_lens = [50, 64, 700, 1000, 17, 300], [1, 64, 1, 300, 17, 1]
    kv = _cache(lens, gen)
    dense = (False, True, False, True, True, True)
    if pages:  # three distinct logical pages a (request, KV head) where the request reads a selection
        idx = torch.stack([torch.stack([torch.randperm(max(3, -(-n // PS)), generator=gen)[:3] % -(-n // PS)
                                        for _ in range(HKV)]) for n in lens]).cuda()
        selection = Selection(idx, torch.full((6, HKV), 3, dtype=torch.int32, device="cuda"), dense, page_size=PS)
    else:
        picks = [torch.randperm(n, generator=gen)[:32].cuda() for n in lens]
        selection = Selection.from_lists([None if d else p for d, p in zip(dense, picks)], HKV, "cuda")
    q = randn(sum(q_lens), HQ, D, generator=gen, dtype=BF16, device="cuda")
    view = _view(kv)
    ctx = _ctx(q_lens, [view, view])
    fi = _providers()[0]
    want, _ = TorchAttentionProvider().attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, None)
    for layer in range(2):
        got, cs = fi.attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, None)
        assert cs is None
        assert_close(got, want, 2e-2, f"layer {layer}")
    full = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    # routed: the prefill over requests 1, 3, 4 (qo_indptr), the decode over request 5 (its page indptr)
    assert planned == ([("prefill", [0, 64, 364, 381]), ("decode", [0, 19])] if route else [("prefill", full)])


@pytest.mark.gpu
def test_decode_step_some_rows_dense(flashinfer, monkeypatch):
    """A decode step where one request reads its whole cache and the others a selection:
    FlashInfer's decode is planned over that request alone; the torch provider's output."""
    from sparseengine.attention.torch_ref import TorchAttentionProvider
    from sparseengine.kernels.testing import assert_close, randn

    planned = []
    plan = flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan
    monkeypatch.setattr(flashinfer.BatchDecodeWithPagedKVCacheWrapper, "plan",
                        lambda self, indptr, *a, **k: (planned.append(indptr.tolist()), plan(self, indptr, *a, **k))[1])
    gen = torch.Generator().manual_seed(6)
    lens = [50, 700, 1000, 300]
    kv = _cache(lens, gen)
    picks = [torch.randperm(n, generator=gen)[:32].cuda() for n in lens]
    selection = Selection.from_lists([picks[0], None, picks[2], picks[3]], HKV, "cuda")
    q = randn(len(lens), HQ, D, generator=gen, dtype=BF16, device="cuda")
    view = _view(kv)
    ctx = _ctx([1] * len(lens), [view])
    want, _ = TorchAttentionProvider().attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, None)
    fi = _providers()[0]
    for layer in range(2):
        got, _ = fi.attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, None)
        assert_close(got, want, 2e-2, f"layer {layer}")
    assert planned == [[0, 44]]  # once for the step, over request 1's 44 pages (700 tokens)


@pytest.mark.gpu
def test_engine_flashinfer_matches_triton_in_bf16(flashinfer, tiny_llama_d128):
    """bf16 (FlashInfer has no fp32): prompt logits from chunked mixed-batch prefill agree
    within bf16 noise (measured as Triton vs torch on the same prompts), and every greedy
    token FlashInfer's decode picks is Triton's top token up to a near tie."""
    from sparseengine import LLM, SamplingParams

    folder = tiny_llama_d128
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (150, 70, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="bfloat16", device="cuda", page_size=PS, num_kv_pages=256, prefill_chunk_size=64,
              max_num_batched_tokens=96, enforce_eager=True)
    logits, tokens = {}, {}
    for provider in ("torch", "triton", "flashinfer"):
        with LLM(str(folder), attention_provider=provider, **kw) as llm:
            assert llm.provider.name == provider
            if provider == "flashinfer":
                assert llm.provider.ops()["prefill"] == "flashinfer" and llm.provider.ops()["decode"] == "flashinfer"
            logits[provider] = llm.prompt_logits(prompts)
            tokens[provider] = [o.token_ids for o in llm.generate(prompts, params)]
    scale = max(t.abs().max().item() for t in logits["triton"])
    noise = max((a - b).abs().max().item() for a, b in zip(logits["triton"], logits["torch"]))
    err = max((a - b).abs().max().item() for a, b in zip(logits["flashinfer"], logits["triton"]))
    assert err <= max(3 * noise, 0.03 * scale), f"prompt logits: flashinfer-triton {err:.4f}, " \
                                                 f"triton-torch {noise:.4f}, scale {scale:.2f}"
    tol = max(4 * err, 4 * noise, 0.02 * scale)
    with LLM(str(folder), attention_provider="triton", **kw) as llm:  # teacher-forced on FlashInfer's picks
        forced = llm.prompt_logits([p + t[:-1] for p, t in zip(prompts, tokens["flashinfer"])])
    for p, toks, lg, tri in zip(prompts, tokens["flashinfer"], forced, tokens["triton"]):
        rows = lg[len(p) - 1:].float()
        picked = rows[torch.arange(len(toks)), torch.tensor(toks)]
        gap = (rows.max(-1).values - picked).max().item()
        assert gap <= tol, f"flashinfer tokens {toks} vs triton {tri}: a pick {gap:.4f} below the top (tol {tol:.4f})"


@pytest.mark.gpu
@pytest.mark.parametrize("method,knobs", [("quest", dict(quest_page_size=8, quest_skip_layers=1)),
                                          ("h2o", {}), ("snapkv", dict(snapkv_window=4))])
def test_engine_sparse_methods_run_with_flashinfer(flashinfer, tiny_llama_d128, method, knobs):
    """Selections and column sums go to Triton inside a FlashInfer engine (bf16, eager)."""
    from sparseengine import LLM, SamplingParams

    folder = tiny_llama_d128
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (23, 17)]
    with LLM(str(folder), attention_provider="flashinfer", dtype="bfloat16", device="cuda", page_size=8,
             num_kv_pages=64, enforce_eager=True, sparse_method=method, sink_tokens=2, budget=8, recent_tokens=4,
             **knobs) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3, 3] and all(o.error is None for o in outs)


@pytest.mark.gpu
def test_engine_pool_sized_by_a_flashinfer_warmup(flashinfer, tiny_llama_d128):
    """The GPU pool sizing runs the largest prefill once through the chosen provider."""
    from sparseengine import LLM, SamplingParams

    torch.cuda.empty_cache()  # blocks cached by earlier tests count as used memory
    with LLM(str(tiny_llama_d128), attention_provider="flashinfer", dtype="bfloat16", device="cuda",
             gpu_memory_utilization=0.3, max_num_batched_tokens=2048, enforce_eager=True) as llm:
        out = llm.generate([[5] * 300], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
