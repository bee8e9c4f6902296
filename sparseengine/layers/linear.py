"""The model's linear layers: cuBLAS (`F.linear`), or, for a decode step's few rows on a
GPU (at most `skinny_linear.ENGINE_MAX_ROWS`), the weight-streaming Triton kernel, which
also takes an MLP's SiLU-and-multiply into its loads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparseengine.kernels import skinny_linear
from sparseengine.kernels.fused_ops import silu_mul


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor, silu_mul_input: bool = False) -> torch.Tensor:
        """`silu_mul_input`: x is an MLP's gate then up `[..., 2 * in_features]`; the
        layer's input is `silu_mul(x)`."""
        rows = x.numel() // max(x.shape[-1], 1)
        if x.is_cuda and 0 < rows <= skinny_linear.ENGINE_MAX_ROWS:
            return skinny_linear.skinny_linear_triton(x, self.weight, self.bias, silu_mul_input=silu_mul_input,
                                                      **skinny_linear.engine_tiles(self.out_features))
        return F.linear(silu_mul(x) if silu_mul_input else x, self.weight, self.bias)
