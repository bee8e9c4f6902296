"""The model's linear layers, each with the small op before it: `linear`, `norm_linear`
(residual add + RMSNorm, then the layer) and `silu_mul_linear` (SiLU-and-multiply, then
the layer). On CUDA, at decode batch sizes (at most `small_m_linear.MAX_M` rows), one
Triton kernel does both (`kernels.small_m_linear`); otherwise the separate ops run as
before (on CPU the torch references, which match Hugging Face token for token; on CUDA the
fused norm/SiLU kernels and cuBLAS). `fused_ops.forced(..., ("linear",))` switches it
either way, for tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparseengine.kernels import small_m_linear as sml
from sparseengine.kernels.fused_ops import runs_as_kernel, silu_mul
from sparseengine.layers.layernorm import RMSNorm


def _small(x: torch.Tensor) -> bool:
    return x.shape[0] <= sml.MAX_M and runs_as_kernel("linear", x)


def linear(x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
    if _small(x):
        return sml.small_m_linear_triton(x, proj.weight, proj.bias)
    return F.linear(x, proj.weight, proj.bias)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                proj: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(x + residual)), x + residual); residual None: (proj(norm(x)), x)."""
    if _small(x):
        return sml.rms_norm_linear_triton(x, residual, norm.weight, norm.eps, proj.weight, proj.bias)
    normed, residual = (norm(x), x) if residual is None else norm(x, residual)
    return F.linear(normed, proj.weight, proj.bias), residual


def silu_mul_linear(gate_up: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
    if _small(gate_up):
        return sml.silu_mul_linear_triton(gate_up, proj.weight, proj.bias)
    return F.linear(silu_mul(gate_up), proj.weight, proj.bias)
