import pytest
import torch

from sparseengine.kernels import (decode_max_logits_ref, decode_max_logits_triton, omnikv_scores_ref,
                                  omnikv_scores_triton, paged_decode_ref, paged_decode_triton)
from sparseengine.kernels.omnikv_scores import group_max_logits_torch
from sparseengine.kernels.testing import CASES, assert_close, case_id, random_paged_kv, randn


def _inputs(case, gen, device, dtype=torch.float32):
    hq, hkv, d, ps, lens = case
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=dtype, device=device)
    return randn(len(lens), hq, d, generator=gen, dtype=dtype, device=device), kv


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("mode", ["logits", "probs"])
def test_scores(case, mode, gen, device):
    hq, hkv, d, ps, lens = case
    q, kv = _inputs(case, gen, device)
    L = max(lens) + 2
    args = (q, kv.k_cache, kv.page_table, kv.kv_lens, mode, L)
    ref = omnikv_scores_ref(*args)
    dense = torch.full((len(lens), L), float("-inf"), device=device)
    for b, n in enumerate(lens):  # plainest: one query head at a time
        k = kv.dense(b)[0]
        for h in range(hq):
            s = k[:, h // (hq // hkv)] @ q[b, h] / d**0.5
            dense[b, :n] = torch.maximum(dense[b, :n], s.softmax(0) if mode == "probs" else s)
    assert_close(ref, dense, 1e-5, "ref")
    assert_close(omnikv_scores_triton(*args), ref, 1e-4, "triton")
    if mode == "probs":  # lse from the filter layer's own attention
        _, lse = paged_decode_triton(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, return_lse=True)
        assert_close(omnikv_scores_triton(*args, lse=lse), ref, 1e-4, "given lse")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["logits", "probs"])
def test_gpu_bf16_32k(mode, gen):
    q, kv = _inputs((32, 8, 128, 16, [32768, 7000]), gen, "cuda", torch.bfloat16)
    args = (q, kv.k_cache, kv.page_table, kv.kv_lens, mode)
    assert_close(omnikv_scores_triton(*args), omnikv_scores_ref(*args), 2e-2)


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("kv_chunk", [None, 16])  # the plan's splits, and many 16-token splits
@pytest.mark.parametrize("fold", [False, True])
def test_decode_max_logits(case, kv_chunk, fold, gen, device):
    """The filter layer's attention with its scores: the output is the plain decode's, the
    scores are each KV head's max over its query heads of q . k / sqrt(d), -inf past the
    row; the max over KV heads of them is OmniKV's ``logits`` score, which ``fold`` returns
    (``[B, 1, L]``) in their place."""
    hq, hkv, d, ps, lens = case
    q, kv = _inputs(case, gen, device)
    L = kv.page_table.shape[1] * ps
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, L)
    out_ref, ref = decode_max_logits_ref(*args)
    plain = torch.full((len(lens), hkv, L), float("-inf"), device=device)
    g = hq // hkv
    for b, n in enumerate(lens):  # one query head at a time
        k = kv.dense(b)[0]
        for h in range(hq):
            plain[b, h // g, :n] = torch.maximum(plain[b, h // g, :n], k[:, h // g] @ q[b, h] / d**0.5)
    assert_close(ref, plain, 1e-5, "ref")
    assert_close(out_ref, paged_decode_ref(*args[:5]), 1e-5, "ref out")
    out, got = decode_max_logits_triton(*args, kv_chunk=kv_chunk, fold=fold)
    want = ref.amax(1, keepdim=True) if fold else ref
    assert got.shape == want.shape and torch.equal(torch.isinf(got), torch.isinf(want))
    assert_close(got, want, 1e-4, "triton scores")
    assert_close(out, out_ref, 1e-4, "triton out")
    got = group_max_logits_torch(q, kv.k_cache, kv.page_table, kv.kv_lens, L)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    full = omnikv_scores_ref(q, kv.k_cache, kv.page_table, kv.kv_lens, "logits", L)
    assert_close(got.amax(1), full, 1e-4, "max over KV heads")


@pytest.mark.parametrize("plan", [dict(kv_chunk=64, block_n=16), dict(kv_chunk=32, block_n=32),
                                  dict(kv_chunk=1024, block_n=16), dict(row_splits=2, block_n=16),
                                  dict(row_splits=2, block_n=16, balanced=True)],
                         ids=["4-tiles-a-chunk", "1-tile", "64-tiles-a-chunk", "per-row", "balanced"])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("all_heads", [False, True])
def test_group_max_logits_by_launch(plan, keep, all_heads, gen, device, monkeypatch):
    """The group max logits the split kernel stores, whatever the launch: fixed chunks of
    several tiles and of one (their maxima held in registers, stored after the loop), and
    a store a tile where a chunk has more tiles than it holds (`MAX_MAXIMA_TILES`), where
    each row cuts its own length, under the balanced plan, and with `KEEP_GROUP_MAXIMA`
    off; a row's last chunk partial, and nothing past a row's length written. With
    ``logits_all_heads`` each KV head's maxima go into one row a request by an atomic max:
    the max over all query heads, exactly (a max does not depend on the order it is taken in)."""
    from sparseengine.kernels import paged_decode
    from sparseengine.kernels.paged_decode import MODE_DENSE, split_k_decode

    monkeypatch.setattr(paged_decode, "KEEP_GROUP_MAXIMA", keep)
    hq, hkv, d, ps, lens = 8, 2, 32, 4, [150, 37, 64]
    q, kv = _inputs((hq, hkv, d, ps, lens), gen, device)
    L = kv.page_table.shape[1] * ps
    out_ref, ref = decode_max_logits_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, L)
    got = torch.full((len(lens), 1 if all_heads else hkv, L), float("-inf"), device=device)
    out = split_k_decode(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, mode=MODE_DENSE, capacity=L,
                         logits=got, logits_group_max=True, logits_all_heads=all_heads, **plan)
    if all_heads:  # the max of the kernel's own per-head maxima, bit for bit
        per_head = torch.full((len(lens), hkv, L), float("-inf"), device=device)
        split_k_decode(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, mode=MODE_DENSE, capacity=L,
                       logits=per_head, logits_group_max=True, **plan)
        assert torch.equal(got, per_head.amax(1, keepdim=True))
        ref = ref.amax(1, keepdim=True)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert_close(got, ref, 1e-4, "scores")
    assert_close(out, out_ref, 1e-4, "out")


def test_all_heads_needs_group_max(gen, device):
    from sparseengine.kernels.paged_decode import MODE_DENSE, split_k_decode

    q, kv = _inputs((4, 2, 16, 4, [9, 3]), gen, device)
    with pytest.raises(ValueError, match="logits_all_heads=True .* needs logits_group_max=True"):
        split_k_decode(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, mode=MODE_DENSE, capacity=12,
                       logits=torch.full((2, 1, 12), float("-inf"), device=device), logits_all_heads=True)


def test_decode_max_logits_unfilled(gen, device):
    """``fill=False`` (the Triton provider's): the same output, and the same scores over
    each row's tokens (past a row nothing is written: the pick never reads there, as
    test_omnikv_select's NaN tails check)."""
    hq, hkv, d, ps, lens = 8, 2, 32, 4, [150, 37, 64]
    q, kv = _inputs((hq, hkv, d, ps, lens), gen, device)
    L = kv.page_table.shape[1] * ps
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, L)
    out_ref, ref = decode_max_logits_ref(*args)
    out, got = decode_max_logits_triton(*args, fill=False, fold=False)
    assert got.shape == ref.shape
    for b, n in enumerate(lens):
        assert_close(got[b, :, :n], ref[b, :, :n], 1e-4, f"row {b}")
    assert_close(out, out_ref, 1e-4, "out")


@pytest.mark.parametrize("fold", [False, True])
def test_decode_max_logits_needs_room(fold, gen, device):
    """Sized by the longest row; a shorter row's tail is -inf (folded: filled whatever ``fill`` says)."""
    q, kv = _inputs((4, 2, 16, 4, [9, 3]), gen, device)
    out, scores = decode_max_logits_triton(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, fold=fold)
    assert tuple(scores.shape) == (2, 1 if fold else 2, 9) and torch.isinf(scores[1, :, 3:]).all()
    if fold:
        _, unfilled = decode_max_logits_triton(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, fill=False,
                                               fold=True)
        assert torch.equal(unfilled, scores)


@pytest.mark.gpu
@pytest.mark.parametrize("fold", [False, True])
def test_gpu_decode_max_logits_bf16_32k(fold, gen):
    q, kv = _inputs((32, 8, 128, 16, [32768, 7000]), gen, "cuda", torch.bfloat16)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, 32768)
    out_ref, ref = decode_max_logits_ref(*args)
    ref = ref.amax(1, keepdim=True) if fold else ref
    out, got = decode_max_logits_triton(*args, fold=fold)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert_close(got, ref, 2e-2, "scores")
    assert_close(out, out_ref, 2e-2, "out")
