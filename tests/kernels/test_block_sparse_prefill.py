import pytest
import torch
import torch.nn.functional as F

from sparseengine.kernels import block_sparse_prefill_ref, block_sparse_prefill_triton
from sparseengine.kernels.testing import assert_close, randn

CASES = [(1, 4, 4, 16, 16), (45, 8, 2, 32, 16), (70, 6, 3, 64, 32), (100, 8, 2, 16, 32)]


def _inputs(n, hq, hkv, d, bs, gen, device, dtype=torch.float32, density=0.5):
    q = randn(n, hq, d, generator=gen, device=device, dtype=dtype)
    k = randn(n, hkv, d, generator=gen, device=device, dtype=dtype)
    v = randn(n, hkv, d, generator=gen, device=device, dtype=dtype)
    nb = -(-n // bs)
    mask = (torch.rand(hq, nb, nb, generator=gen) < density).to(device)
    return q, k, v, mask


def dense_block_sparse(q, k, v, mask, bs):
    n, hq, d = q.shape
    g = hq // k.shape[1]
    out = torch.empty(n, hq, d, device=q.device)
    for h in range(hq):
        allowed = torch.zeros(n, n, dtype=torch.bool, device=q.device)
        for i in range(n):
            for j in range(i + 1):
                allowed[i, j] = bool(mask[h, i // bs, j // bs]) or i // bs == j // bs
        out[:, h] = F.scaled_dot_product_attention(q[None, :, h].float(), k[None, :, h // g].float(),
                                                   v[None, :, h // g].float(), attn_mask=allowed)[0]
    return out


@pytest.mark.parametrize("n,hq,hkv,d,bs", CASES)
def test_block_sparse(n, hq, hkv, d, bs, gen, device):
    q, k, v, mask = _inputs(n, hq, hkv, d, bs, gen, device)
    ref = block_sparse_prefill_ref(q, k, v, mask, bs)
    assert_close(ref, dense_block_sparse(q, k, v, mask, bs), 1e-5, "ref")
    assert_close(block_sparse_prefill_triton(q, k, v, mask, bs), ref, 1e-4, "triton")


def test_full_mask_is_causal_dense(gen, device):
    q, k, v, mask = _inputs(50, 8, 2, 32, 16, gen, device)
    dense = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(4, 1).transpose(0, 1),
                                           v.repeat_interleave(4, 1).transpose(0, 1), is_causal=True)
    assert_close(block_sparse_prefill_triton(q, k, v, torch.ones_like(mask), 16), dense.transpose(0, 1), 1e-4)


@pytest.mark.gpu
def test_gpu_bf16(gen):
    q, k, v, mask = _inputs(4000, 32, 8, 128, 128, gen, "cuda", torch.bfloat16, density=0.3)
    assert_close(block_sparse_prefill_triton(q, k, v, mask), block_sparse_prefill_ref(q, k, v, mask), 2e-2)
