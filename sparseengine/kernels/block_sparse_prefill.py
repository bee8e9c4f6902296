"""Block-sparse causal prefill attention for one sequence (flashprefill_v2 compute).

`q [n, Hq, d]`, `k/v [n, Hkv, d]` (contiguous tokens, GQA), `block_mask [Hq, n_qblocks,
n_kblocks]` bool: query block i attends key block j < i iff the mask says so; the diagonal
block j = i is always computed with the causal rule inside it; blocks j > i never.
`n_qblocks = n_kblocks = ceil(n / block_size)`. Estimating the mask from probe blocks is
the method's job (torch), not this kernel's. The engine's paged version is
`block_sparse_paged_prefill.py`.

Triton: one program per (query block, query head) runs an online softmax over the kept
key blocks; a skipped block costs one mask byte. Tiles are block_size x block_size, so
block_size must be a power of two >= 16.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _common
from ._common import LOG2E, cdiv, check_launch, lazy_jit, next_pow2
from .online_softmax import softmax_step

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


def block_sparse_prefill_ref(q, k, v, block_mask, block_size=128, scale=None):
    n, Hq, d = q.shape
    Hkv = k.shape[1]
    g, scale = Hq // Hkv, _common.default_scale(d, scale)
    _check(q, k, v, block_mask, block_size)
    idx = torch.arange(n, device=q.device)
    qb, kb = idx[:, None] // block_size, idx[None, :] // block_size
    out = torch.empty(n, Hq, d, dtype=torch.float32, device=q.device)
    for h in range(Hq):
        allowed = (idx[None, :] <= idx[:, None]) & (block_mask[h][qb, kb] | (qb == kb))
        s = (q[:, h].float() @ k[:, h // g].float().T) * scale
        out[:, h] = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ v[:, h // g].float()
    return out.to(q.dtype)


def block_sparse_prefill_triton(q, k, v, block_mask, block_size=128, scale=None):
    n, Hq, d = q.shape
    _check(q, k, v, block_mask, block_size)
    device = check_launch(q, k, v, block_mask)
    _common.check_dtypes(q, k, v)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = block_mask.to(torch.int8).contiguous()
    out = _common.empty((n, Hq, d), q.dtype, device)
    nb = cdiv(n, block_size)
    _block_sparse_kernel[(nb, Hq)](
        q, k, v, out, mask, _common.default_scale(d, scale) * LOG2E, n,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), mask.stride(0), mask.stride(1),
        GROUP=Hq // k.shape[1], HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), BLOCK=block_size,
        DOT_PREC=_common.dot_precision(q.dtype), num_warps=8 if block_size >= 128 else 4, num_stages=2,
    )
    return out


def _check(q, k, v, block_mask, block_size):
    n, Hq, d = q.shape
    nb = cdiv(n, block_size)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if k.shape[0] != n or v.shape != k.shape or k.shape[2] != d or Hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not match k/v {tuple(k.shape)}")
    if tuple(block_mask.shape) != (Hq, nb, nb):
        raise ValueError(f"block_mask must be [{Hq}, {nb}, {nb}], got {tuple(block_mask.shape)}")


@lazy_jit
def _block_sparse_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, mask_ptr, qk_scale, n,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_mh, stride_mq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    qb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offs_m = qb * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < n
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    mask_row = mask_ptr + h * stride_mh + qb * stride_mq
    for kb in range(0, qb + 1):
        if (tl.load(mask_row + kb) != 0) | (kb == qb):
            offs_n = kb * BLOCK + tl.arange(0, BLOCK)
            n_ok = offs_n < n
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offs_n[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask,
                        other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            s = tl.where(n_ok[None, :] & (offs_n[None, :] <= offs_m[:, None]), s, float("-inf"))
            m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)
            v = tl.load(v_ptr + offs_n[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask,
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
