"""The model's linear layers: cuBLAS (`F.linear`), or, for a decode step's few rows on a
GPU, the weight-streaming Triton kernel where `skinny_linear.ENGINE_MAX_ROWS` allows it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparseengine.kernels import skinny_linear
from sparseengine.kernels.fused_ops import silu_mul


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor, silu_mul_output: bool = False) -> torch.Tensor:
        """`silu_mul_output`: the layer is an MLP's gate then up projection and returns
        `silu_mul` of its output (in the Triton kernel's epilogue where that runs)."""
        rows = x.numel() // max(x.shape[-1], 1)
        if x.is_cuda and 0 < rows <= skinny_linear.ENGINE_MAX_ROWS:
            fused = silu_mul_output and skinny_linear.FUSE_SILU_MUL
            y = skinny_linear.skinny_linear_triton(x, self.weight, self.bias, silu_mul_output=fused,
                                                   **skinny_linear.engine_tiles(self.out_features, x.dtype))
            return silu_mul(y) if silu_mul_output and not fused else y
        y = F.linear(x, self.weight, self.bias)
        return silu_mul(y) if silu_mul_output else y
