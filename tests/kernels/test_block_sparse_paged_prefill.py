"""Block-sparse prefill over the paged cache (flashprefill_v2 in the Triton provider): the
Triton kernels against their torch reference (``BlockMask.token_mask`` + the paged
reference), the reference against a per-row loop written from the ``BlockMask``
docstring, and the provider helper against the torch provider."""

import math

import pytest
import torch

from sparseengine.attention.torch_ref import TorchAttentionProvider
from sparseengine.attention.triton_provider import TritonAttentionProvider
from sparseengine.engine.step_context import BlockMask, LayerView, ScoreRows, Selection, StepContext
from sparseengine.kernels import paged_prefill_ref, paged_prefill_triton, prefill_window_colsum_ref
from sparseengine.kernels.block_sparse_paged_prefill import (block_sparse_paged_attend, block_sparse_paged_prefill_ref,
                                                       block_sparse_paged_prefill_triton,
                                                       block_sparse_window_colsum_ref,
                                                       block_sparse_window_colsum_triton)
from sparseengine.kernels.testing import assert_close, random_paged_kv, randn

# (Hq, Hkv, d, page_size, block, [(kv_len, q_len, mask)]); mask "rand" (40% of blocks), "full"
# (every entry True) or None (dense causal). Rows start at 0, mid-block and on a block edge;
# a 1-row request stands for a decode row.
CASES = [
    (4, 4, 16, 8, 16, [(70, 70, "rand"), (50, 23, "rand"), (41, 1, None)]),  # GQA 1, page < block
    (8, 4, 16, 16, 16, [(100, 37, "rand"), (33, 33, None), (64, 16, "rand")]),  # GQA 2, page = block
    (8, 2, 32, 32, 16, [(90, 45, "rand"), (129, 60, "full")]),  # GQA 4, page > block
    (4, 1, 16, 4, 32, [(150, 100, "rand"), (40, 9, "rand"), (20, 1, "rand")]),  # GQA 4, block 32
    (2, 1, 16, 16, 256, [(600, 400, "rand"), (300, 300, None)]),  # block > tile: 2 x 2 tiles per block
]


def case_id(case):
    hq, hkv, d, ps, bs, reqs = case
    return f"hq{hq}-hkv{hkv}-ps{ps}-bs{bs}-" + "_".join(f"{n}q{m}" for n, m, _ in reqs)


def mask_shape(hq, n, q_len, bs):
    first = (n - q_len) // bs
    return hq, (n - 1) // bs - first + 1, -(-n // bs)


def make_inputs(case, gen, device, dtype=torch.float32, density=0.4):
    hq, hkv, d, ps, bs, reqs = case
    kv = random_paged_kv([n for n, _, _ in reqs], hkv, d, ps, generator=gen, dtype=dtype, device=device)
    q_lens = [m for _, m, _ in reqs]
    cu = torch.tensor([0] + q_lens).cumsum(0).int().to(device)
    q = randn(sum(q_lens), hq, d, generator=gen, dtype=dtype, device=device)
    masks = []
    for n, m, kind in reqs:
        shape = mask_shape(hq, n, m, bs)
        masks.append(None if kind is None else
                     torch.ones(shape, dtype=torch.bool, device=device) if kind == "full" else
                     (torch.rand(shape, generator=gen) < density).to(device))
    return q, kv, cu, masks


def row_loop(q, kv, cu, masks, bs):
    """Per row and head, the keys the BlockMask docstring allows, softmax in float64."""
    hq, d = q.shape[1:]
    g = hq // kv.k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(masks)):
        k, v = (x.double().cpu() for x in kv.dense(b))
        n, start, m = int(kv.kv_lens[b]), int(cu[b]), int(cu[b + 1] - cu[b])
        first = (n - m) // bs
        for i in range(m):
            p = n - m + i
            for h in range(hq):
                keys = [t for t in range(p + 1) if masks[b] is None or t // bs == p // bs
                        or bool(masks[b][h, p // bs - first, t // bs])]
                s = k[keys, h // g] @ q[start + i, h].double().cpu() / math.sqrt(d)
                out[start + i, h] = torch.softmax(s, 0) @ v[keys, h // g]
    return out


@pytest.mark.parametrize("case", CASES[:4], ids=case_id)
def test_ref_matches_row_loop(case, gen, device):
    q, kv, cu, masks = make_inputs(case, gen, device)
    got = block_sparse_paged_prefill_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu, masks, case[4])
    assert_close(got, row_loop(q, kv, cu, masks, case[4]), 1e-5)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_matches_ref(case, gen, device):
    q, kv, cu, masks = make_inputs(case, gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu, masks, case[4])
    out_ref, lse_ref = block_sparse_paged_prefill_ref(*args, return_lse=True)
    out, lse = block_sparse_paged_prefill_triton(*args, return_lse=True)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(lse, lse_ref, 1e-4, "lse")
    q_lens = [m for _, m, _ in case[5]]
    assert_close(block_sparse_paged_prefill_triton(*args, kv_lens_list=kv.kv_lens.tolist(), q_lens=q_lens),
                 out_ref, 1e-4, "host lens")


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=case_id)
def test_all_true_masks_are_dense_paged_prefill(case, gen, device):
    q, kv, cu, masks = make_inputs(case, gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu)
    dense = paged_prefill_ref(*args)
    full = [torch.ones(mask_shape(q.shape[1], int(n), int(cu[b + 1] - cu[b]), case[4]), dtype=torch.bool,
                       device=device) for b, n in enumerate(kv.kv_lens)]
    assert_close(block_sparse_paged_prefill_ref(*args, full, case[4]), dense, 1e-5, "ref full")
    assert_close(block_sparse_paged_prefill_ref(*args, [None] * len(full), case[4]), dense, 1e-5, "ref None")
    assert_close(block_sparse_paged_prefill_triton(*args, full, case[4]), dense, 1e-4, "full")
    assert_close(block_sparse_paged_prefill_triton(*args, [None] * len(full), case[4]), dense, 1e-4, "None")


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=case_id)
def test_window_colsum(case, gen, device):
    q, kv, cu, masks = make_inputs(case, gen, device)
    args = (q, kv.k_cache, kv.page_table, kv.kv_lens, cu)
    L = int(kv.kv_lens.max()) + 3  # wider than any request: the tail must be zeros
    _, lse = block_sparse_paged_prefill_triton(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu, masks,
                                               case[4], return_lse=True)
    for window in (1, 5, 64):
        ref = block_sparse_window_colsum_ref(*args, window, masks, case[4], max_kv_len=L)
        assert_close(block_sparse_window_colsum_triton(*args, window, masks, case[4], max_kv_len=L, lse=lse), ref,
                     1e-4, f"window {window}")
        assert_close(block_sparse_window_colsum_triton(*args, window, masks, case[4], max_kv_len=L), ref, 1e-4,
                     f"window {window}, own lse")
        rows = torch.tensor([min(window, int(cu[b + 1] - cu[b])) for b in range(len(masks))], dtype=torch.float32)
        torch.testing.assert_close(ref.sum(-1).cpu(), rows[:, None].expand(-1, ref.shape[1]))
    assert_close(block_sparse_window_colsum_ref(*args, 7, [None] * len(masks), case[4]),
                 prefill_window_colsum_ref(*args, 7), 1e-6, "dense")


def test_rejects_bad_block_sizes_and_masks(gen, device):
    q, kv, cu, masks = make_inputs(CASES[0], gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu)
    for fn in (block_sparse_paged_prefill_ref, block_sparse_paged_prefill_triton):
        with pytest.raises(ValueError, match="power of two"):
            fn(*args, masks, 24)
        with pytest.raises(ValueError, match="masks\\[0\\]"):
            fn(*args, [masks[1]] + masks[1:], 16)
        odd = torch.zeros(8, 24, *kv.k_cache.shape[2:], dtype=q.dtype, device=device)  # pages of 24 tokens
        with pytest.raises(ValueError, match="multiple"):
            fn(q, odd, odd, kv.page_table, kv.kv_lens, cu, masks, 16)


def test_provider_helper_matches_torch_provider(gen, device, monkeypatch):
    """A mixed step: two block-sparse prefill chunks, a dense one, two decode rows (one
    reading a selection), with score rows; the Triton provider's helper against the torch
    provider, routed and not. Routed, the column sums' kernel runs over the requests that
    are not routed only."""
    from sparseengine.kernels import block_sparse_paged_prefill as bsp

    hq, hkv, d, ps, bs = 4, 2, 16, 8, 16
    reqs = [(90, 40, "rand"), (50, 50, "rand"), (30, 30, None), (61, 1, None), (45, 1, None)]
    q, kv, cu, masks = make_inputs((hq, hkv, d, ps, bs, reqs), gen, device)
    lens, q_lens = tuple(n for n, _, _ in reqs), tuple(m for _, m, _ in reqs)
    view = LayerView(slot_mapping=torch.zeros(0, dtype=torch.long, device=device), kv_lens=kv.kv_lens,
                     kv_lens_list=lens, page_table=kv.page_table)
    picked = torch.tensor([[0, 3, 17, 40, 60], [1, 2, 30, 59, 60]], device=device)
    selection = Selection.from_lists([None, None, None, picked, None], hkv, device)
    block_mask = BlockMask(bs, tuple(masks))
    triton = TritonAttentionProvider()
    launched = []
    colsum_kernel = bsp.block_sparse_window_colsum_triton
    monkeypatch.setattr(bsp, "block_sparse_window_colsum_triton",
                        lambda *a, **k: launched.append(tuple(k["kv_lens_list"])) or colsum_kernel(*a, **k))
    # (a decode row with both a selection and score rows: no method asks for that; the
    # providers differ there, as they do without block masks)
    for sel, rows in ((None, None), (None, ScoreRows((6, 50, 0, 1, 0))), (None, ScoreRows((0, 0, 0, 1, 1))),
                      (selection, None), (selection, ScoreRows((40, 3, 30, 0, 1)))):
        ctx = StepContext(seqs=[None] * len(reqs), q_lens=q_lens, cu_q_lens=cu, is_decode=False, views=[view],
                          kv_cache=None, provider=None, method=None, positions=None)
        want, want_cs = TorchAttentionProvider().attend(q, kv.k_cache, kv.v_cache, ctx, view, sel, rows,
                                                        block_mask=block_mask)
        for route in (False, True):  # the one-row requests (dense causal) to the split-K decode or not
            launched.clear()
            got, got_cs = block_sparse_paged_attend(q, kv.k_cache, kv.v_cache, ctx, view, sel, rows, block_mask,
                                                    triton.attend, route)
            assert_close(got, want, 1e-4, f"out route={route} rows={rows}")
            assert (got_cs is None) == (want_cs is None)
            for b, (a, e) in enumerate(zip(got_cs or [], want_cs or [])):
                assert a.shape == e.shape
                assert_close(a, e, 1e-4, f"colsum {b} route={route} rows={rows}")
            asking = [b for b, r in enumerate(rows.rows if rows else ()) if r and (q_lens[b] > 1 or not route)]
            windows = {rows.rows[b] for b in asking}
            assert launched == [tuple(lens[b] for b in asking) if route else lens] * len(windows)
        via_provider = triton.attend(q, kv.k_cache, kv.v_cache, ctx, view, sel, rows, block_mask=block_mask)[0]
        assert_close(via_provider, got, 1e-6, "provider (routes, as the last helper call)")


def test_skip_one_row_leaves_those_rows_unwritten(gen, device):
    """(The kernel tests' conftest makes every buffer a wrapper allocates start as NaN.)"""
    reqs = [(90, 40, "rand"), (61, 1, None), (30, 30, None), (20, 1, None)]
    q, kv, cu, masks = make_inputs((4, 2, 16, 8, 16, reqs), gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu, masks, 16)
    out, lse = block_sparse_paged_prefill_triton(*args, return_lse=True, skip_one_row=True)
    want, want_lse = block_sparse_paged_prefill_ref(*args, return_lse=True)
    one = torch.tensor([m == 1 for _, m, _ in reqs]).repeat_interleave(torch.tensor([m for _, m, _ in reqs]))
    assert out[one].isnan().all() and lse[one].isnan().all()
    assert_close(out[~one], want[~one], 1e-4, "prefill rows")
    assert_close(lse[~one], want_lse[~one], 1e-4, "prefill lse")


@pytest.mark.gpu
@pytest.mark.parametrize("ps,bs", [(16, 128), (256, 128), (16, 64)])
def test_gpu_bf16_llama_shape(gen, ps, bs):
    """Llama-3.1-8B attention shape: a whole prompt, a chunk starting mid-block, a dense
    request and a decode row; both page-table paths; column sums."""
    reqs = [(5000, 5000, "rand"), (9000, 3000, "rand"), (3000, 1000, None), (7000, 1, None)]
    q, kv, cu, masks = make_inputs((32, 8, 128, ps, bs, reqs), gen, "cuda", torch.bfloat16, density=0.3)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu)
    out_ref, lse_ref = block_sparse_paged_prefill_ref(*args, masks, bs, return_lse=True)
    out, lse = block_sparse_paged_prefill_triton(*args, masks, bs, return_lse=True)
    assert_close(out, out_ref, 2e-2, "out")
    assert_close(lse, lse_ref, 1e-3, "lse")
    full = [torch.ones(mask_shape(32, n, m, bs), dtype=torch.bool, device="cuda") for n, m, _ in reqs]
    assert_close(block_sparse_paged_prefill_triton(*args, full, bs), paged_prefill_triton(*args), 2e-2, "full")
    cargs = (q, kv.k_cache, kv.page_table, kv.kv_lens, cu, 32, masks, bs)
    assert_close(block_sparse_window_colsum_triton(*cargs, lse=lse), block_sparse_window_colsum_ref(*cargs), 2e-2,
                 "colsum")


@pytest.mark.gpu
def test_gpu_routed_decode_rows(gen):
    """bf16 Llama shape, a mixed step under a block mask: decode rows at 128K and 7K beside two
    block-sparse chunks, routed to the split-K decode and not, against the reference."""
    reqs = [(5000, 2000, "rand"), (131072, 1, None), (9000, 3000, "rand"), (7000, 1, None)]
    q, kv, cu, masks = make_inputs((32, 8, 128, 16, 128, reqs), gen, "cuda", torch.bfloat16, density=0.3)
    view = LayerView(slot_mapping=torch.zeros(0, dtype=torch.long, device="cuda"), kv_lens=kv.kv_lens,
                     kv_lens_list=tuple(n for n, _, _ in reqs), page_table=kv.page_table)
    ctx = StepContext(seqs=[None] * len(reqs), q_lens=tuple(m for _, m, _ in reqs), cu_q_lens=cu, is_decode=False,
                      views=[view], kv_cache=None, provider=None, method=None, positions=None)
    want = block_sparse_paged_prefill_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu, masks, 128)
    for route in (False, True):
        got, _ = block_sparse_paged_attend(q, kv.k_cache, kv.v_cache, ctx, view, None, None,
                                           BlockMask(128, tuple(masks)), TritonAttentionProvider().attend, route)
        assert_close(got, want, 2e-2, f"route={route}")
