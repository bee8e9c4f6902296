"""The online-softmax step the attention kernels share (split-K decode, the causal paged
block of the chunked and block-sparse prefills, block-sparse prefill over dense K/V): one
key block's scores folded into the running max and sum. A plain function: `LazyKernel`
jits it into each calling kernel's module (the compiler inlines it), the interpreter runs
it as Python."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._common import shared_helper

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


@shared_helper
def softmax_step(s, m_i, l_i):
    """Scores ``s [M, N]`` (log2 domain, -inf where masked) into the running max ``m_i [M]``
    and sum ``l_i [M]``: returns ``(m_new, alpha, p, l_new)``; the caller scales its
    accumulator by ``alpha`` and adds ``p @ v``. A row whose scores are all -inf so far
    keeps m = -inf and weight 0 (exponents taken from 0 there, so nothing is NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)
