import pytest
import torch
import torch.nn.functional as F

from sparseengine.kernels import paged_decode_ref, paged_decode_triton
from sparseengine.kernels.testing import CASES, assert_close, case_id, random_paged_kv, randn


def _inputs(case, gen, device, dtype=torch.float32):
    hq, hkv, d, ps, lens = case
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=dtype, device=device)
    q = randn(len(lens), hq, d, generator=gen, dtype=dtype, device=device)
    return q, kv


def dense_decode(q, kv):
    """Plainest oracle: SDPA over each request's K/V gathered through flat slots."""
    B, hq, d = q.shape
    g = hq // kv.k_cache.shape[2]
    out = []
    for b in range(B):
        k, v = kv.dense(b)
        k, v = k.float().repeat_interleave(g, 1).transpose(0, 1), v.float().repeat_interleave(g, 1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[b].float()[:, None], k, v)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ref_matches_dense(case, gen, device):
    q, kv = _inputs(case, gen, device)
    out, lse = paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, return_lse=True)
    assert_close(out, dense_decode(q, kv), 1e-5, "out")
    g, d = q.shape[1] // kv.k_cache.shape[2], q.shape[2]
    dense_lse = torch.stack([
        torch.logsumexp(torch.einsum("hd,nhd->hn", q[b], kv.dense(b)[0].repeat_interleave(g, 1)) / d**0.5, -1)
        for b in range(q.shape[0])])
    assert_close(lse, dense_lse, 1e-5, "lse")


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("kv_chunk", [16, None])
def test_triton_matches_ref(case, kv_chunk, gen, device):
    q, kv = _inputs(case, gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    out_ref, lse_ref = paged_decode_ref(*args, return_lse=True)
    out, lse = paged_decode_triton(*args, return_lse=True, kv_chunk=kv_chunk)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(lse, lse_ref, 1e-4, "lse")
    assert_close(paged_decode_triton(*args, scale=0.3, kv_chunk=kv_chunk), paged_decode_ref(*args, scale=0.3))


def test_empty_request_and_strided_q(gen, device):
    q, kv = _inputs((8, 2, 32, 4, [0, 21, 3]), gen, device)
    q = torch.cat([q, q], dim=-1)[..., :32]  # non-contiguous rows
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    out, lse = paged_decode_triton(*args, return_lse=True, kv_chunk=16)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    out_ref, lse_ref = paged_decode_ref(*args, return_lse=True)
    assert_close(out, out_ref)
    assert_close(lse, lse_ref)


def test_fp16(gen, device):
    q, kv = _inputs(CASES[1], gen, device, torch.float16)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    out = paged_decode_triton(*args, kv_chunk=32)
    assert out.dtype == torch.float16
    assert_close(out, paged_decode_ref(*args), 3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[32768, 32000], [131072]], ids=["b2-32k", "b1-128k"])
def test_gpu_bf16_long(lens, gen):
    q, kv = _inputs((32, 8, 128, 16, lens), gen, "cuda", torch.bfloat16)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    out, lse = paged_decode_triton(*args, return_lse=True)
    out_ref, lse_ref = paged_decode_ref(*args, return_lse=True)
    assert_close(out, out_ref, 2e-2, "out")
    assert_close(lse, lse_ref, 1e-3, "lse")
