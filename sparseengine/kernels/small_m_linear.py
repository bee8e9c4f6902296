"""Linear layers at decode batch sizes (M <= 16 rows), with the op before them fused in.

At decode time a linear layer streams its weight once per step for a handful of rows:
its speed is the bandwidth it reaches, and the small op before it (the residual add +
RMSNorm before qkv and gate_up, SiLU-and-multiply before down) is one more launch and one
more gap in the CUDA graph. One Triton kernel (`fused_ops_kernels._small_m_linear_kernel`)
does both: one program per `block_n` output features reads their whole weight rows in
`block_k` chunks and multiplies them with the M rows of the prologue's output, padded to
16 on the tensor cores, fp32 accumulation, no split over K (so no second reduce kernel,
as cuBLAS's split-K decode GEMMs launch).

- `small_m_linear_triton(x, w, bias)`: `F.linear(x, w, bias)`.
- `silu_mul_linear_triton(gate_up, w)`: `F.linear(silu(gate) * up, w)`.
- `rms_norm_linear_triton(x, residual, norm_w, eps, w, bias)`: `(F.linear(RMSNorm(h) *
  norm_w, w, bias), h)` with `h = x + residual` (or `x` when residual is None).

The `_ref` functions are the torch compositions they replace (the code the model runs
on CPU; `fused_ops`'s references for the norm and SiLU). The prologue reproduces those
ops' roundings; the matrix product is not cuBLAS's summation order, so results agree to
bf16 rounding, not bit for bit (the tests bound it). `sparseengine.layers.linear` picks
the kernel on CUDA for M <= 16 (`fused_ops.forced(..., ("linear",))` switches it for
tests); `python -m sparseengine.kernels.bench_gpu --small-m-linear` times it beside
cuBLAS with the separate op (`bench_linear.py`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _common
from ._common import cdiv, check_launch, interpreting, next_pow2
from .fused_ops import add_rms_norm_ref, rms_norm_ref, silu_mul_ref
from .fused_ops_kernels import _small_m_linear_kernel

MAX_M = 16
_PROLOGUE = {"none": 0, "silu_mul": 1, "rms_norm": 2}


def small_m_linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, bias)


def silu_mul_linear_ref(gate_up: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(silu_mul_ref(gate_up), w, bias)


def rms_norm_linear_ref(x, residual, norm_w, eps, w, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    normed, h = (rms_norm_ref(x, norm_w, eps), x) if residual is None else add_rms_norm_ref(x, residual, norm_w, eps)
    return F.linear(normed, w, bias), h


def small_m_linear_triton(x, w, bias=None, **tile) -> torch.Tensor:
    """`x [M, K]` (M <= 16), `w [N, K]`, `bias [N]` or None, one dtype -> `y [M, N]`.
    `tile`: `block_n`, `block_k`, `num_warps`, `num_stages` (defaults: `default_tile`)."""
    return _launch("none", x, None, None, 0.0, w, bias, tile)[0]


def silu_mul_linear_triton(gate_up, w, bias=None, **tile) -> torch.Tensor:
    """`gate_up [M, 2K]` (gate, then up), `w [N, K]` -> `F.linear(silu(gate) * up, w, bias)`."""
    return _launch("silu_mul", gate_up, None, None, 0.0, w, bias, tile)[0]


def rms_norm_linear_triton(x, residual, norm_w, eps, w, bias=None, **tile) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]`, `residual [M, K]` or None, `norm_w [K]` -> `(y [M, N], h)`: y the linear
    layer of RMSNorm(h) * norm_w, h = x + residual (a new tensor), or x itself."""
    return _launch("rms_norm", x, residual, norm_w, eps, w, bias, tile)


def default_tile(n: int, k: int, prologue: str) -> dict:
    """Launch parameters by shape. Wide layers take 64 features a program: half as many
    programs redo the prologue over the rows (the norm's sum of squares, the SiLU)."""
    if n >= 16384:
        return dict(block_n=64, block_k=128, num_warps=4, num_stages=5)
    return dict(block_n=32, block_k=256, num_warps=4, num_stages=4)


def _launch(prologue, x, residual, norm_w, eps, w, bias, tile):
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x must be [M, K] and w [N, K], got {_shape(x)} and {_shape(w)}")
    M, N, K = x.shape[0], w.shape[0], w.shape[1]
    if x.shape[1] != (2 * K if prologue == "silu_mul" else K):
        want = "[M, 2K] (gate, then up)" if prologue == "silu_mul" else "[M, K]"
        raise ValueError(f"x must be {want} for w [N={N}, K={K}], got {tuple(x.shape)}")
    if M > MAX_M:
        raise ValueError(f"small_m_linear handles at most {MAX_M} rows, got {M}")
    others = {"residual": residual, "norm weight": norm_w, "bias": bias}
    for name, t in others.items():
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    if w.dtype != x.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must be x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if norm_w is not None and norm_w.shape != (K,):
        raise ValueError(f"the norm weight must be [K={K}], got {tuple(norm_w.shape)}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be [N={N}], got {tuple(bias.shape)}")
    if w.stride(1) != 1:
        raise ValueError("w must be contiguous along K")
    x = x if x.stride(1) == 1 else x.contiguous()
    residual = residual if residual is None or residual.stride(1) == 1 else residual.contiguous()
    device = check_launch(*(t for t in (x, w, residual, norm_w, bias) if t is not None))
    y = _common.empty((M, N), x.dtype, device)
    h = _common.empty((M, K), x.dtype, device) if residual is not None else x
    if M == 0 or N == 0:
        return y, h
    t = {**default_tile(N, K, prologue), **tile}
    block_n = max(16, min(int(t["block_n"]), next_pow2(N)))
    block_k = max(16, min(int(t["block_k"]), next_pow2(K)))
    r = residual if residual is not None else x  # a dummy where absent: never read
    _small_m_linear_kernel[(cdiv(N, block_n),)](
        x, r, norm_w if norm_w is not None else x, w, bias if bias is not None else x, y, h,
        M, N, K, x.stride(0), r.stride(0), w.stride(0), y.stride(0), float(eps),
        PROLOGUE=_PROLOGUE[prologue], HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=MAX_M, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PREC=_common.dot_precision(x.dtype),
        INTERPRET=interpreting(), num_warps=int(t["num_warps"]), num_stages=int(t["num_stages"]),
    )
    return y, h


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
