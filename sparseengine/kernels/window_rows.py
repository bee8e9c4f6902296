"""The observation window's rows, as the window-score kernels pack them (SnapKV/PyramidKV
scores at the end of a prefill): the last ``w_eff`` query tokens of a request x the
``GROUP`` query heads of a KV head, ``G_PAD`` rows per token; and what the plain and the
block-masked window column sums share (a tile of keys through the page table, the rows'
probabilities against it). Plain functions: `LazyKernel` jits them into each calling
kernel's module, the interpreter runs them as Python."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._common import shared_helper

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


@shared_helper
def window_rows(offs_r, w_eff, q_len, kv_len, q_start, kvh, GROUP: tl.constexpr, G_PAD: tl.constexpr):
    """Rows ``offs_r`` -> ``(row_ok, pos, hq, t)``: whether the row is a real (token, head)
    of the window, the token's absolute position, its query head, its packed row in q."""
    w = offs_r // G_PAD
    hh = offs_r % G_PAD
    row_ok = (w < w_eff) & (hh < GROUP)
    i = q_len - w_eff + w
    return row_ok, kv_len - q_len + i, kvh * GROUP + hh, q_start + i


@shared_helper
def paged_key_tile(k_ptr, table, offs_n, n_ok, kvh, stride_kp, stride_ko, stride_kh, offs_d, d_ok,
                   PAGE_SIZE: tl.constexpr):
    """Keys ``offs_n`` of KV head ``kvh`` (those ``n_ok``; page ids at ``table``) -> ``[N, D]``."""
    page = tl.load(table + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    return tl.load(k_ptr + page[:, None] * stride_kp + (offs_n % PAGE_SIZE)[:, None] * stride_ko
                   + kvh * stride_kh + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)


@shared_helper
def window_key_probs(k, offs_n, n_ok, offs_r, q_ptr, lse_ptr, w_eff, q_len, kv_len, q_start, kvh, qk_scale,
                     stride_qt, stride_qh, offs_d, d_ok, HQ, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                     DOT_PREC: tl.constexpr):
    """The window rows ``offs_r`` against keys ``k [N, D]`` at cache indices ``offs_n``: their
    softmax probabilities (from the rows' log-sum-exp at ``lse_ptr``, natural log), where
    the pair counts (a real row, a valid key at or before the row), and the rows' positions
    and query heads: ``(p [R, N], ok, pos, hq)``."""
    row_ok, pos, hq, t = window_rows(offs_r, w_eff, q_len, kv_len, q_start, kvh, GROUP, G_PAD)
    q = tl.load(q_ptr + t[:, None] * stride_qt + hq[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(lse_ptr + t * HQ + hq, mask=row_ok, other=0.0) * 1.4426950408889634
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    ok = row_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
    return tl.exp2(s - lse[:, None]), ok, pos, hq
