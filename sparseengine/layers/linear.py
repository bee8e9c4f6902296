"""The model's linear layers: cuBLAS (`F.linear`), or, for a decode step's few rows on a
GPU, the weight-streaming Triton kernel where `skinny_linear.ENGINE_MAX_ROWS` allows it.

`norm` and `residual` fold the RMSNorm before a layer (whose weight the model has folded
into this layer's, leaving the norm a unit weight) and the residual add after it into the
layer: into the Triton kernel where it runs (`skinny_linear_triton`'s `rms_eps` and
`residual`), as the norm, the linear and the add otherwise. `glu` makes a gate_up layer
return SiLU(gate) * up: in the kernel's epilogue, or as `fused_ops.silu_mul` after it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparseengine.kernels import skinny_linear
from sparseengine.kernels.fused_ops import silu_mul


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, residual: torch.Tensor | None = None,
                glu: bool = False) -> torch.Tensor:
        """`norm`: an RMSNorm of unit weight (`eps`) applied to x first; `residual`: added to
        the result; `glu`: this layer is a gate_up (gate rows, then up rows), return
        `fused_ops.silu_mul` of its output (in the Triton kernel's epilogue where it runs and
        `skinny_linear.GLU_EPILOGUE` is on)."""
        if skinny_linear.streams(x):
            fused = glu and skinny_linear.GLU_EPILOGUE
            y = skinny_linear.skinny_linear_triton(
                x, self.weight, self.bias, rms_eps=None if norm is None else norm.eps, residual=residual,
                glu=fused, **skinny_linear.engine_tiles(self.out_features, x.dtype))
            return silu_mul(y) if glu and not fused else y
        y = F.linear(x if norm is None else norm(x), self.weight, self.bias)
        if glu:
            y = silu_mul(y)
        return y if residual is None else y + residual
