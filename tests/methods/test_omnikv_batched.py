"""OmniKV's batched pure-decode choice is the per-request definition, for every request.

- On random paged K/Q (shuffled pages, unowned slots NaN), driven through the runtime's
  hooks and the provider's attention as the attention layer calls them (``logits`` scores
  come from the filter layer's own attention), with a CUDA-graph-shaped context (``seqs = [None] * B``, dummy host
  lengths): each request's selection == ``omnikv_select(omnikv_token_scores(q_b, K_b))``, ties
  aside, for lengths below, at and past the total, several budgets, GQA groupings and
  both score modes; layers before the first filter and the filter layers stay dense.
- ``omnikv_scores_torch`` == ``omnikv_scores_ref``; the Triton scores (interpreted on a
  CPU) choose what the torch scores choose.
- On the tiny Llama, a batch of decoding requests of different lengths generates the same
  tokens through the batched path as through the per-request path.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from sparseengine import LLM, SamplingParams
from sparseengine.attention.provider import make_provider
from sparseengine.config import Config
from sparseengine.engine.step_context import LayerView, ScoreRows, StepContext
from sparseengine.kernels import omnikv_scores_ref, sparse_decode_ref
from sparseengine.kernels.omnikv_scores import omnikv_scores_torch
from sparseengine.kernels.testing import assert_close, random_paged_kv, randn
from sparseengine.methods import omnikv
from sparseengine.methods.selection import omnikv_select, omnikv_token_scores

SCORE_RTOL = 1e-5  # "ties aside": scores this close (relative to the largest) may swap
NUM_LAYERS, FILTERS = 4, "1,2"


def runtime(hkv: int, sink: int, budget: int, recent: int, mode: str) -> omnikv.OmniKV:
    cfg = Config.from_kwargs(sparse_method="omnikv", sink_tokens=sink, budget=budget, recent_tokens=recent,
                             omnikv_filter_layers=FILTERS, omnikv_score=mode)
    model = types.SimpleNamespace(name="tiny", num_layers=NUM_LAYERS, num_kv_heads=hkv)
    return omnikv.OmniKV(cfg, model, cache=None)


def graph_context(rt, kv, provider: str = "torch") -> StepContext:
    """What a CUDA-graph capture hands the method: no host requests, dummy host lengths."""
    B = kv.kv_lens.shape[0]
    view = LayerView(torch.full((B,), -1, dtype=torch.long), kv.kv_lens, (1,) * B, kv.page_table)
    cache = types.SimpleNamespace(layer=lambda layer: (kv.k_cache, kv.v_cache))
    return StepContext(seqs=[None] * B, q_lens=(1,) * B, cu_q_lens=torch.arange(B + 1, dtype=torch.int32),
                       is_decode=True, views=[view] * NUM_LAYERS, kv_cache=cache,
                       provider=make_provider(provider, kv.k_cache.device), method=rt,
                       positions=torch.zeros(B, dtype=torch.long))


def assert_same_choice(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, where: str) -> None:
    """``got == want`` as sets, or another top-k of ``scores`` within float tolerance."""
    g, w = set(got.tolist()), set(want.tolist())
    assert len(g) == len(got) == len(want), f"{where}: {got.tolist()} vs {want.tolist()}"
    if g == w:
        return
    scale = float(scores.abs().max())
    inside, outside = scores[sorted(g - w)], scores[sorted(w - g)]
    assert float(inside.min()) >= float(outside.max()) - SCORE_RTOL * scale, (
        f"{where}: chose {sorted(g - w)} over {sorted(w - g)}")


def check_requests(sel, q, kv, sink, budget, recent, mode, where) -> None:
    total = sink + budget + recent
    B, hkv = q.shape[0], kv.k_cache.shape[2]
    assert sel.dense == (False,) * B
    assert tuple(sel.token_indices.shape) == (B, hkv, total) and sel.token_indices.dtype == torch.long
    assert tuple(sel.num_selected.shape) == (B, hkv)
    for b, n in enumerate(kv.kv_lens.tolist()):
        k = kv.dense(b)[0]
        scores = omnikv_token_scores(q[b], k, mode)
        want = omnikv_select(scores, sink, budget, recent)
        counts = sel.num_selected[b].tolist()
        assert counts == [len(want)] * hkv, f"{where} request {b} (n={n}): counts {counts}"
        rows = sel.token_indices[b, :, : len(want)]
        assert torch.equal(rows, rows[:1].expand_as(rows)), f"{where}: heads differ"
        assert torch.equal(rows[0], rows[0].sort().values), f"{where}: not ascending"
        assert_same_choice(rows[0], want, scores, f"{where} request {b} (n={n})")


# (Hq, Hkv, sink, budget, recent, lengths): below, at, one past, and far past the total
CASES = [
    (4, 4, 4, 16, 8, [1, 27, 28, 29, 97]),
    (4, 2, 2, 5, 3, [9, 10, 11, 64, 33]),
    (8, 2, 0, 12, 0, [12, 13, 70]),
    (6, 2, 3, 20, 1, [24, 25, 150]),
    (8, 1, 5, 0, 4, [9, 10, 40]),  # no budget: sink + recent only
    (4, 2, 2, 40, 2, [30, 44]),  # nothing past the total: every request reads everything
]


@pytest.mark.parametrize("mode", ["logits", "probs"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}q{c[1]}kv-s{c[2]}b{c[3]}r{c[4]}")
def test_batched_choice_is_the_per_request_definition(case, mode):
    hq, hkv, sink, budget, recent, lens = case
    gen = torch.Generator().manual_seed(len(lens) * 100 + budget)
    kv = random_paged_kv(lens, hkv, 16, 8, generator=gen, extra_cols=2)
    q = randn(len(lens), hq, 16, generator=gen) * 2  # peaked enough that probs differ from uniform
    rt = runtime(hkv, sink, budget, recent, mode)
    ctx = graph_context(rt, kv)
    rt.begin_step_graph([])
    assert attend_layer(rt, 0, q, ctx) is None  # before the first filter layer: dense
    assert attend_layer(rt, 1, q, ctx) is None  # filter layers attend densely
    first = attend_layer(rt, 3, q, ctx)  # ... and the next layer reads the filter layer's choice
    check_requests(first, q, kv, sink, budget, recent, mode, f"{mode} layer 3")
    assert attend_layer(rt, 2, q, ctx) is None and rt.select(3, q, ctx) is not first  # the next filter re-chooses


def attend_layer(rt, layer, q, ctx):
    """What ``layers.attention.Attention`` does with a layer (the step's K/V already in the
    cache): the selection, the provider's attention and its scores handed back."""
    k_cache, v_cache = ctx.kv_cache.layer(layer)
    sel, rows = rt.select(layer, q, ctx), rt.score_rows(layer, ctx)
    _, scores = ctx.provider.attend(q, k_cache, v_cache, ctx, ctx.views[layer], sel, rows)
    if rows is not None:
        rt.observe(layer, q, scores, ctx)
    return sel


@pytest.mark.parametrize("mode", ["logits", "probs"])
def test_logits_come_from_the_filter_layers_attention(mode):
    """``logits``: a pure-decode filter layer asks its attention for max logits as wide as
    the page table (no second pass over K); ``probs`` scores in ``select``; steps with
    prefill rows use neither."""
    gen = torch.Generator().manual_seed(9)
    kv = random_paged_kv([30, 50], 2, 16, 8, generator=gen)
    rt = runtime(2, 2, 6, 3, mode)
    ctx = graph_context(rt, kv)
    rows = rt.score_rows(1, ctx)
    assert rt.score_rows(0, ctx) is None and rt.score_rows(3, ctx) is None
    if mode == "probs":
        assert rows is None
    else:
        assert rows.kind == "max_logits" and rows.rows == (1, 1) and rows.max_kv_len == kv.page_table.shape[1] * 8
    prefill = types.SimpleNamespace(is_decoding=False)
    mixed = dataclasses.replace(ctx, seqs=[prefill, None], is_decode=False)
    assert rt.score_rows(1, mixed) is None


def test_max_logit_scores_are_a_decode_score():
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreted Triton provider
    gen = torch.Generator().manual_seed(1)
    kv = random_paged_kv([30], 2, 16, 8, generator=gen, device=device)
    q = randn(1, 4, 16, generator=gen, device=device)
    for kind in ("torch", "triton"):
        rt = runtime(2, 2, 6, 3, "logits")
        ctx = graph_context(rt, kv, provider=kind)
        rows = rt.score_rows(1, ctx)
        prefill = dataclasses.replace(ctx, is_decode=False)
        with pytest.raises(ValueError, match="decode-step score"):
            ctx.provider.attend(q, kv.k_cache, kv.v_cache, prefill, ctx.views[1], None, rows)
    with pytest.raises(ValueError, match="needs max_kv_len"):
        ScoreRows((1,), kind="max_logits")
    with pytest.raises(ValueError, match="kind must be one of"):
        ScoreRows((1,), kind="probs")


@pytest.mark.parametrize("mode", ["logits", "probs"])
def test_torch_scores_equal_the_reference(mode):
    gen = torch.Generator().manual_seed(3)
    kv = random_paged_kv([5, 40, 17], 2, 16, 4, generator=gen, extra_cols=3)
    q = randn(3, 6, 16, generator=gen)
    L = kv.page_table.shape[1] * 4
    got = omnikv_scores_torch(q, kv.k_cache, kv.page_table, kv.kv_lens, mode, L)
    want = omnikv_scores_ref(q, kv.k_cache, kv.page_table, kv.kv_lens, mode, L)
    assert torch.isinf(want).eq(torch.isinf(got)).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["logits", "probs"])
def test_triton_scores_choose_what_torch_scores_choose(mode):
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: tests/conftest sets TRITON_INTERPRET=1
    gen = torch.Generator().manual_seed(5)
    sink, budget, recent = 2, 6, 3
    kv = random_paged_kv([7, 11, 12, 50], 2, 16, 8, generator=gen, device=device)
    q = randn(4, 4, 16, generator=gen, device=device) * 2
    picks = {}
    for name, triton in (("torch", False), ("triton", True)):
        scores = omnikv.score_cached_tokens(q, kv.k_cache, kv.page_table, kv.kv_lens, mode, triton)
        picks[name] = omnikv.pick_tokens(scores, kv.kv_lens, sink, budget, recent) + (scores,)
    (ti, tc, ts), (gi, gc, gs) = picks["torch"], picks["triton"]
    torch.testing.assert_close(gs, ts, rtol=1e-4, atol=1e-6)
    assert torch.equal(gc, tc) and tc.tolist() == [7, 11, 11, 11]
    for b, n in enumerate(tc.tolist()):
        assert_same_choice(gi[b, :n].cpu(), ti[b, :n].cpu(), ts[b].cpu(), f"{mode} request {b}")
    # through the runtime: a Triton provider scores with the Triton kernels
    rt = runtime(2, sink, budget, recent, mode)
    ctx = graph_context(rt, kv, provider="triton")
    attend_layer(rt, 1, q, ctx)
    sel = rt.select(3, q, ctx)
    check_requests(sel, q.cpu(), kv_on_cpu(kv), sink, budget, recent, mode, "triton provider")
    if mode == "probs":  # scored in select(), not by the fused pick
        assert sel.pool_rows is None
        return
    # the fused pick also wrote the chosen tokens' pool rows, and the provider's attention
    # reads them: with the token ids zeroed it still attends over the chosen tokens
    counted = torch.arange(sel.token_indices.shape[-1], device=device) < sel.num_selected[..., None]
    tok = torch.where(counted, sel.token_indices, 0)
    pages = kv.page_table.long()[:, None, :].expand(-1, tok.shape[1], -1).gather(2, tok // 8)
    assert torch.equal(sel.pool_rows.long(), torch.where(counted, pages * 8 + tok % 8, -1))
    want = sparse_decode_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, sel.token_indices,
                             sel.num_selected)
    blind = dataclasses.replace(sel, token_indices=torch.zeros_like(sel.token_indices))
    out, _ = ctx.provider.attend(q, kv.k_cache, kv.v_cache, ctx, ctx.views[3], blind, None)
    assert_close(out, want, 1e-4, "attention over the pool rows")


@pytest.mark.parametrize("fold", [True, False])
def test_triton_filter_layer_hands_over_folded_or_per_head_scores(fold, monkeypatch):
    """A Triton filter layer's max logits come back ``[B, 1, L]`` (the KV heads folded in by
    the attention, ``FOLD_KV_HEADS``) or ``[B, Hkv, L]``; the torch provider's per KV head.
    The next layer's choice is the definition's either way."""
    pytest.importorskip("triton")
    from sparseengine.kernels import omnikv_scores

    monkeypatch.setattr(omnikv_scores, "FOLD_KV_HEADS", fold)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(8)
    sink, budget, recent = 2, 5, 3
    kv = random_paged_kv([9, 40, 33], 2, 16, 8, generator=gen, device=device)
    q = randn(3, 4, 16, generator=gen, device=device)
    rt = runtime(2, sink, budget, recent, "logits")
    shapes = {}
    for provider, (pq, pkv) in (("torch", (q.cpu(), kv_on_cpu(kv))), ("triton", (q, kv))):
        ctx = graph_context(rt, pkv, provider=provider)  # the torch provider on the CPU
        rows = rt.score_rows(1, ctx)
        _, scores = ctx.provider.attend(pq, pkv.k_cache, pkv.v_cache, ctx, ctx.views[1], None, rows)
        shapes[provider] = tuple(scores.shape)
        rt.observe(1, pq, scores, ctx)
        check_requests(rt.select(3, pq, ctx), q.cpu(), kv_on_cpu(kv), sink, budget, recent, "logits", provider)
    width = kv.page_table.shape[1] * 8
    assert shapes == {"torch": (3, 2, width), "triton": (3, 1 if fold else 2, width)}


def kv_on_cpu(kv):
    return type(kv)(*(t.cpu() for t in (kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)))


@pytest.mark.parametrize("mode", ["logits", "probs"])
def test_engine_tokens_batched_equal_per_request(tiny_llama, monkeypatch, mode):
    folder, hf = tiny_llama
    gen = torch.Generator().manual_seed(11)
    # total 14: prompts below, at and past it (the short ones cross it while decoding)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 14, 31, 52)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", page_size=8, kv_cache_memory=0.01, attention_provider="torch",
              sparse_method="omnikv", omnikv_filter_layers="1", omnikv_score=mode,
              sink_tokens=2, budget=8, recent_tokens=4)
    calls = {"batched": 0, "per_request": 0}
    batched, per_request = omnikv.OmniKV._selection_of, omnikv.OmniKV._choose_per_request

    def spy(name, fn):
        def wrapped(self, *args):
            calls[name] += 1
            return fn(self, *args)
        return wrapped

    monkeypatch.setattr(omnikv.OmniKV, "_selection_of", spy("batched", batched))
    monkeypatch.setattr(omnikv.OmniKV, "_choose_per_request", spy("per_request", per_request))
    outs = {}
    with LLM(str(folder), **kw) as llm:
        outs["batched"] = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls["batched"] >= 7  # every decode step after the first went the batched way
    monkeypatch.setattr(omnikv, "pure_decode", lambda ctx: False)
    before = calls["batched"]
    with LLM(str(folder), **kw) as llm:
        outs["per_request"] = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls["batched"] == before
    assert outs["batched"] == outs["per_request"]


def test_the_record_names_the_pick_and_its_bytes():
    """`pick_kernel` names what makes a filter layer's pick (the records'
    `engine/method_kernels/omnikv_select`), and the byte model counts what that pick moves per
    cached token: the Triton pick's int32 keys (written once, read five times) beside the
    folded fp32 score; the CUDA pick keeps its keys in shared memory."""
    from sparseengine.kernels import omnikv_select_cuda, omnikv_select_triton

    cpu = torch.device("cpu")
    assert omnikv.pick_kernel(cpu, make_provider("torch", cpu)) == "torch"
    assert omnikv.max_logit_bytes_per_token(8, cpu) == omnikv.max_logit_bytes_per_token(8) == 12 + 24
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreted Triton provider
    name = omnikv.pick_kernel(device, make_provider("triton", device))
    if omnikv_select_cuda.runs_on(device):
        assert name.startswith("cuda (clusters of 16") and omnikv.max_logit_bytes_per_token(8, device) == 12
        assert omnikv.pick_key_bytes(device) == 0
    else:
        assert name == "triton" and omnikv.max_logit_bytes_per_token(8, device) == 12 + 24
        assert omnikv.pick_key_bytes(device) == 24 and omnikv.gpu_pick(torch.zeros(2, 40)) is omnikv_select_triton
