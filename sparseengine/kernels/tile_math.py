"""Elementwise and tile arithmetic that kernels of several modules share, rounded as the
engine's torch references round: a float32 value rounded to a dtype, a weight tile's dot
with a few rows (float32 accumulation), SiLU-and-multiply. Plain functions: `LazyKernel`
jits them into each calling kernel's module (the compiler inlines them), the interpreter
runs them as Python."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._common import shared_helper

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice


@shared_helper
def _round_to(v, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 v rounded (to nearest even) to DTYPE, as float32."""
    if DTYPE == tl.float32:
        return v
    elif INTERPRET and DTYPE == tl.bfloat16:  # the interpreter truncates float32 -> bf16
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    else:
        return v.to(DTYPE).to(tl.float32)


@shared_helper
def _tile_dot(w, x, acc, INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + w @ x.T in float32."""
    if INTERPRET:  # the interpreter's bf16 tl.dot is wrong; float32 products of bf16 are exact
        w, x = w.to(tl.float32), x.to(tl.float32)
    return tl.dot(w, tl.trans(x), acc, input_precision=DOT_PREC)


@shared_helper
def _silu_mul_value(gate, up, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """silu(gate) * up of float32 `gate`, `up` (values of DTYPE) as torch rounds `F.silu(gate) *
    up` in DTYPE: the SiLU rounded, the product rounded; float32. Bit for bit with torch on
    the GPU when the launch keeps libdevice's non-FTZ functions (`enable_reflect_ftz=False`)
    and contracts no product into an add (`enable_fp_fusion=False`)."""
    if INTERPRET:
        silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    else:  # torch: x / (1 + expf(-x)), IEEE division
        silu = libdevice.div_rn(gate, 1.0 + libdevice.exp(-gate))
    return _round_to(_round_to(silu, DTYPE, INTERPRET) * up, DTYPE, INTERPRET)
