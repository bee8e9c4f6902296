import pytest
import torch

from sparseengine.kernels import (decode_colsum_ref, decode_colsum_triton, paged_decode_ref,
                                  paged_prefill_triton, prefill_window_colsum_ref, prefill_window_colsum_triton)
from sparseengine.kernels.testing import CASES, assert_close, case_id, random_paged_kv, randn


def _probs(qrows, k, scale, causal=None):
    """Plainest softmax: exp(s - max) / sum over each row; qrows [r, d], k [n, d]."""
    s = (qrows.float() @ k.float().T) * scale
    if causal is not None:
        s = s.masked_fill(~causal, float("-inf"))
    e = (s - s.max(-1, keepdim=True).values).exp()
    return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_colsum(case, gen, device):
    hq, hkv, d, ps, lens = case
    g = hq // hkv
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, device=device)
    q = randn(len(lens), hq, d, generator=gen, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    L = max(lens) + 3  # wider than any row: the tail must be zeros
    out_ref, col_ref = decode_colsum_ref(*args, max_kv_len=L)
    dense = torch.zeros(len(lens), hkv, L, device=device)
    for b, n in enumerate(lens):
        k = kv.dense(b)[0]
        for h in range(hkv):
            dense[b, h, :n] = _probs(q[b, h * g:(h + 1) * g], k[:, h], d**-0.5).mean(0)
    assert_close(col_ref, dense, 1e-5, "ref colsum")
    assert_close(out_ref, paged_decode_ref(*args), 1e-6, "ref out")
    out, col = decode_colsum_triton(*args, max_kv_len=L, kv_chunk=16)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(col, col_ref, 1e-4, "colsum")
    assert torch.allclose(col.sum(-1), torch.ones(len(lens), hkv, device=device), atol=1e-5)


def _window_inputs(case, gen, device, dtype=torch.float32):
    hq, hkv, d, ps, lens = case
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=dtype, device=device)
    q_lens = [n if b % 2 == 0 else min(n, 3) for b, n in enumerate(lens)]  # some shorter than the window
    cu = torch.tensor([0] + q_lens, device=device).cumsum(0).int()
    return randn(int(cu[-1]), hq, d, generator=gen, dtype=dtype, device=device), kv, cu


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("window", [8, 5])
def test_prefill_window_colsum(case, window, gen, device):
    hq, hkv, d, ps, lens = case
    g = hq // hkv
    q, kv, cu = _window_inputs(case, gen, device)
    args = (q, kv.k_cache, kv.page_table, kv.kv_lens, cu, window)
    ref = prefill_window_colsum_ref(*args)
    dense = torch.zeros_like(ref)
    for b, n in enumerate(lens):
        m = int(cu[b + 1] - cu[b])
        k = kv.dense(b)[0]
        for i in range(max(0, m - window), m):  # one window row at a time
            visible = torch.arange(n, device=device) <= n - m + i
            for h in range(hkv):
                p = _probs(q[int(cu[b]) + i, h * g:(h + 1) * g], k[:, h], d**-0.5, visible[None])
                dense[b, h, :n] += p.sum(0) / g
    assert_close(ref, dense, 1e-5, "ref")
    assert_close(prefill_window_colsum_triton(*args), ref, 1e-4, "no lse")
    _, lse = paged_prefill_triton(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu, return_lse=True)
    assert_close(prefill_window_colsum_triton(*args, lse=lse), ref, 1e-4, "lse")


@pytest.mark.gpu
def test_gpu_bf16_32k(gen):
    lens = [32768, 9000]
    kv = random_paged_kv(lens, 8, 128, 16, generator=gen, dtype=torch.bfloat16, device="cuda")
    q = randn(2, 32, 128, generator=gen, dtype=torch.bfloat16, device="cuda")
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    out, col = decode_colsum_triton(*args)
    out_ref, col_ref = decode_colsum_ref(*args)
    assert_close(out, out_ref, 2e-2, "out")
    assert_close(col, col_ref, 2e-2, "colsum")
    cu = torch.tensor([0, 64, 64 + 9000], device="cuda").int()
    qp = randn(64 + 9000, 32, 128, generator=gen, dtype=torch.bfloat16, device="cuda")
    wargs = (qp, kv.k_cache, kv.page_table, kv.kv_lens, cu, 32)
    assert_close(prefill_window_colsum_triton(*wargs), prefill_window_colsum_ref(*wargs), 2e-2, "window")
