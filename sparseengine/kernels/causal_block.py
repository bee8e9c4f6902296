"""One key block of causal attention over the paged cache, folded into the running softmax
of a tile of query rows: the step the chunked prefill (`paged_prefill`) and the
block-sparse prefill's diagonal blocks (`block_sparse_paged_prefill_kernels`) share. A
plain function: `LazyKernel` jits it (and the online-softmax step it calls) into each
calling kernel's module; the interpreter runs it as Python."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._common import shared_helper
from .online_softmax import softmax_step

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


@shared_helper
def causal_paged_block(q, acc, m_i, l_i, n0, kv_len, row_pos, table, k_ptr, v_ptr, kvh, qk_scale,
                       stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, offs_d, d_ok,
                       PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                       MASKED: tl.constexpr):
    """Keys ``n0 .. n0 + BLOCK_N`` (those below ``kv_len``; page ids at ``table``) against
    the query rows ``q [M, D]`` at cache positions ``row_pos [M]``, causal (a key at or
    before its row): returns the accumulator ``acc [M, D]``, running max ``m_i`` and sum
    ``l_i`` with the block folded in. ``MASKED`` False: the caller knows every key of the
    block lies below ``kv_len`` and at or before every row, so nothing is masked."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_len
    if MASKED:
        page = tl.load(table + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        page = tl.load(table + offs_n // PAGE_SIZE).to(tl.int64)
    off = offs_n % PAGE_SIZE
    kv_mask = (n_ok[:, None] & d_ok[None, :]) if MASKED else d_ok[None, :]
    k = tl.load(k_ptr + page[:, None] * stride_kp + off[:, None] * stride_ko + kvh * stride_kh
                + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if MASKED:
        s = tl.where(n_ok[None, :] & (offs_n[None, :] <= row_pos[:, None]), s, float("-inf"))
    m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)
    v = tl.load(v_ptr + page[:, None] * stride_vp + off[:, None] * stride_vo + kvh * stride_vh
                + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i
