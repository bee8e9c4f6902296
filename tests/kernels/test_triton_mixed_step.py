"""A mixed step on the Triton provider (prefill chunks beside decode rows): the decode rows
go to the split-K decode (`triton_provider.ROUTE_DECODE_ROWS`) and the chunked prefill
skips them; outputs and column sums against the torch provider, with the routing on and
off, for dense decode rows and for token, pool-row and page selections (interpreted on
the CPU at small shapes; compiled at the Llama-3.1-8B shape in the `gpu` test)."""

import pytest
import torch

from sparseengine.attention import triton_provider
from sparseengine.attention.torch_ref import TorchAttentionProvider
from sparseengine.attention.triton_provider import TritonAttentionProvider
from sparseengine.engine.step_context import LayerView, ScoreRows, Selection, StepContext
from sparseengine.kernels import paged_prefill_ref, paged_prefill_triton
from sparseengine.kernels.testing import assert_close, random_paged_kv, randn

# (kv_len, q_len): decode rows (q_len 1) between prefill chunks, a chunk mid-cache, a whole prompt
REQS = [(61, 1), (90, 40), (33, 1), (50, 50), (129, 1), (20, 1)]


def make_step(reqs, hq, hkv, d, ps, gen, device, dtype=torch.float32):
    kv = random_paged_kv([n for n, _ in reqs], hkv, d, ps, generator=gen, dtype=dtype, device=device)
    q_lens = tuple(m for _, m in reqs)
    cu = torch.tensor((0,) + q_lens).cumsum(0).int().to(device)
    q = randn(sum(q_lens), hq, d, generator=gen, dtype=dtype, device=device)
    view = LayerView(slot_mapping=torch.zeros(0, dtype=torch.long, device=device), kv_lens=kv.kv_lens,
                     kv_lens_list=tuple(n for n, _ in reqs), page_table=kv.page_table)
    ctx = StepContext(seqs=[None] * len(reqs), q_lens=q_lens, cu_q_lens=cu, is_decode=False, views=[view],
                      kv_cache=None, provider=None, method=None, positions=None)
    return q, kv, view, ctx


def selections(reqs, hkv, ps, page_table, gen, device):
    """Token, pool-row and page selections for the decode rows but the last (dense)."""
    sel = [None if m > 1 or b == len(reqs) - 1 else b for b, (_, m) in enumerate(reqs)]
    tokens = [None if b is None else torch.stack([torch.randperm(reqs[b][0], generator=gen)[:9].sort().values
                                                  for _ in range(hkv)]).to(device) for b in sel]
    by_tokens = Selection.from_lists(tokens, hkv, device)
    t = by_tokens.token_indices
    rows = page_table.long().gather(1, (t // ps).flatten(1)).view_as(t) * ps + t % ps
    valid = torch.arange(t.shape[-1], device=device) < by_tokens.num_selected[..., None]
    by_rows = Selection(t, by_tokens.num_selected, by_tokens.dense, 0, torch.where(valid, rows, -1))
    pages = [None if b is None else torch.stack([torch.randperm(-(-reqs[b][0] // ps), generator=gen)[:3].sort().values
                                                 for _ in range(hkv)]).to(device) for b in sel]
    by_pages = Selection.from_lists(pages, hkv, device)
    by_pages = Selection(by_pages.token_indices, by_pages.num_selected, by_pages.dense, ps)
    return {"none": None, "tokens": by_tokens, "pool_rows": by_rows, "pages": by_pages}


@pytest.mark.parametrize("route", [True, False], ids=["routed", "not_routed"])
@pytest.mark.parametrize("kind", ["none", "tokens", "pool_rows", "pages"])
def test_mixed_step_matches_torch_provider(gen, device, monkeypatch, route, kind):
    hq, hkv, d, ps = 8, 2, 16, 8
    q, kv, view, ctx = make_step(REQS, hq, hkv, d, ps, gen, device)
    selection = selections(REQS, hkv, ps, kv.page_table, gen, device)[kind]
    monkeypatch.setattr(triton_provider, "ROUTE_DECODE_ROWS", route)
    # score rows only where no decode row reads a selection (the providers differ there)
    rows = ScoreRows((0, 6, 1, 50, 0, 1)) if selection is None else None
    want, want_cs = TorchAttentionProvider().attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, rows)
    got, got_cs = TritonAttentionProvider().attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, rows)
    assert_close(got, want, 1e-4, "out")
    assert (got_cs is None) == (want_cs is None)
    for b, (a, e) in enumerate(zip(got_cs or [], want_cs or [])):
        assert_close(a, e, 1e-4, f"colsum {b}")


@pytest.mark.parametrize("kind", ["tokens", "pool_rows", "pages"])
def test_decode_step_some_rows_dense(gen, device, monkeypatch, kind):
    """A decode step where one request reads its whole cache and the others a selection:
    the torch provider's output, and each kernel reads only its own rows (the dense decode
    the dense request's, the sparse decode the others')."""
    from sparseengine import kernels

    reqs = [(61, 1), (33, 1), (129, 1), (20, 1)]
    q, kv, view, ctx = make_step(reqs, 8, 2, 16, 8, gen, device)
    ctx.is_decode = True
    selection = selections(reqs, 2, 8, kv.page_table, gen, device)[kind]
    assert selection.dense == (False, False, False, True)
    seen = []
    for name in ("paged_decode_triton", "sparse_decode_triton", "sparse_rows_decode_triton",
                 "sparse_page_decode_triton"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda q, *a, _fn=fn, _name=name, **k: (
            seen.append((_name, q.shape[0])), _fn(q, *a, **k))[1])
    want, _ = TorchAttentionProvider().attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, None)
    got, _ = TritonAttentionProvider().attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, None)
    assert_close(got, want, 1e-4, "out")
    sparse = {"tokens": "sparse_decode_triton", "pool_rows": "sparse_rows_decode_triton",
              "pages": "sparse_page_decode_triton"}[kind]
    assert sorted(seen) == sorted([("paged_decode_triton", 1), (sparse, 3)])


def test_routing_runs_the_prefill_kernel_without_the_decode_rows(gen, device, monkeypatch):
    """With the routing on, the chunked prefill is launched with `skip_one_row` and the
    large-tile rule sees only the requests it computes (`min_q_len` of the chunks)."""
    q, kv, view, ctx = make_step(REQS, 8, 2, 16, 8, gen, device)
    calls = []
    real = paged_prefill_triton

    def spy(*args, **kw):
        calls.append({k: kw[k] for k in ("min_q_len", "skip_one_row")})
        return real(*args, **kw)

    monkeypatch.setattr(triton_provider.kernels, "paged_prefill_triton", spy)
    for route in (True, False):
        monkeypatch.setattr(triton_provider, "ROUTE_DECODE_ROWS", route)
        TritonAttentionProvider().attend(q, kv.k_cache, kv.v_cache, ctx, view, None, None)
    assert calls == [dict(min_q_len=40, skip_one_row=True), dict(min_q_len=1, skip_one_row=False)]


def test_prefill_kernel_leaves_one_row_requests_unwritten(gen, device):
    """(The kernel tests' conftest makes every buffer a wrapper allocates start as NaN.)"""
    q, kv, view, ctx = make_step(REQS, 8, 2, 16, 8, gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, ctx.cu_q_lens)
    out, lse = paged_prefill_triton(*args, return_lse=True, skip_one_row=True)
    want, want_lse = paged_prefill_ref(*args, return_lse=True)
    one = torch.tensor([m == 1 for m in ctx.q_lens]).repeat_interleave(torch.tensor(ctx.q_lens)).to(device)
    assert out[one].isnan().all() and lse[one].isnan().all()
    assert_close(out[~one], want[~one], 1e-4, "prefill rows")
    assert_close(lse[~one], want_lse[~one], 1e-4, "prefill lse")


def test_selection_take(device):
    t = torch.arange(3 * 2 * 4, device=device).view(3, 2, 4)
    n = torch.tensor([[1, 2], [3, 4], [0, 1]], dtype=torch.int32, device=device)
    sel = Selection(t, n, (True, False, False), 8, t + 100)
    sub = sel.take([2, 0])
    assert torch.equal(sub.token_indices, t[[2, 0]]) and torch.equal(sub.num_selected, n[[2, 0]])
    assert torch.equal(sub.pool_rows, t[[2, 0]] + 100)
    assert sub.dense == (False, True) and sub.page_size == 8
    assert Selection(t, n, (True, False, False)).take([1]).pool_rows is None
    with pytest.raises(ValueError, match=r"requests \[3\] out of range for a selection of 3"):
        sel.take([0, 3])
    with pytest.raises(ValueError, match="at least one request"):
        sel.take([])


def test_step_group(device):
    """A sub-step of some requests: their indices, their rows of the packed q, a context of
    their own, the cut views; made once a step; bad lists raise."""
    q_lens = (1, 3, 1, 2)
    cu = torch.tensor([0, 1, 4, 5, 7], dtype=torch.int32, device=device)
    pos = torch.arange(100, 107, device=device)
    ctx = StepContext(["a", "b", "c", "d"], q_lens, cu, False, [], None, None, None, pos)
    view = LayerView(torch.arange(50, 57, device=device), torch.tensor([9, 8, 7, 6], dtype=torch.int32, device=device),
                     (9, 8, 7, 6), torch.arange(8, device=device).view(4, 2))
    g = ctx.group([3, 0])
    assert g.reqs.tolist() == [3, 0] and g.rows.tolist() == [5, 6, 0]
    assert g.step.q_lens == (2, 1) and g.step.cu_q_lens.tolist() == [0, 2, 3] and not g.step.is_decode
    assert g.step.seqs == ["d", "a"] and g.step.positions.tolist() == [105, 106, 100]
    assert g.step.cu_q_lens.dtype == torch.int32 and g.step.views == []
    cut = g.view(view)
    assert cut.slot_mapping.numel() == 0 and cut.kv_lens.tolist() == [6, 9] and cut.kv_lens_list == (6, 9)
    assert cut.page_table.tolist() == [[6, 7], [0, 1]]
    assert g.view(view) is cut and ctx.group((3, 0)) is g  # once a step
    packed = torch.arange(7 * 2, device=device).view(7, 2)  # a tensor packed by the step's rows
    assert g.rows_of(packed).tolist() == [[10, 11], [12, 13], [0, 1]]
    out = torch.full((7, 2), -1, device=device)
    assert g.put_rows(out, torch.tensor([[1, 2], [3, 4], [5, 6]], device=device)) is out
    assert out.tolist() == [[5, 6]] + [[-1, -1]] * 4 + [[1, 2], [3, 4]]
    assert ctx.group([0, 2]).step.is_decode
    for bad in ([], [4], [1, 1], [-1]):
        with pytest.raises(ValueError, match="distinct requests in range"):
            ctx.group(bad)
    sel = Selection(torch.arange(24, device=device).view(4, 2, 3), torch.ones(4, 2, dtype=torch.int32, device=device),
                    (False,) * 4)
    for index in (g.reqs, None):
        sub = sel.take([3, 0], index)
        assert torch.equal(sub.token_indices, sel.token_indices[[3, 0]])
        assert torch.equal(sub.num_selected, sel.num_selected[[3, 0]]) and sub.dense == (False, False)


@pytest.mark.gpu
def test_gpu_llama_shape_mixed_step(gen, monkeypatch):
    """bf16, Hq 32 / Hkv 8 / d 128, page 16: a 4K chunk at 32K beside decode rows at 128K,
    8K and 1K, routed and not, against the torch provider; with a page selection too."""
    reqs = [(131072, 1), (32768, 4096), (8192, 1), (1024, 1)]
    q, kv, view, ctx = make_step(reqs, 32, 8, 128, 16, gen, "cuda", torch.bfloat16)
    pages = [None, None] + [torch.arange(0, 64, 2, device="cuda").expand(8, -1), None]
    sel = Selection.from_lists(pages, 8, "cuda")
    sel = Selection(sel.token_indices, sel.num_selected, sel.dense, 16)
    for selection in (None, sel):
        want, _ = TorchAttentionProvider().attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, None)
        for route in (True, False):
            monkeypatch.setattr(triton_provider, "ROUTE_DECODE_ROWS", route)
            got, _ = TritonAttentionProvider().attend(q, kv.k_cache, kv.v_cache, ctx, view, selection, None)
            assert_close(got, want, 2e-2, f"route={route} selection={selection is not None}")
