"""The observation window's rows, as the window-score kernels pack them (SnapKV/PyramidKV
scores at the end of a prefill): the last ``w_eff`` query tokens of a request x the
``GROUP`` query heads of a KV head, ``G_PAD`` rows per token. A plain function:
`LazyKernel` jits it into each calling kernel's module, the interpreter runs it as Python."""
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
