"""The model's linear layers: cuBLAS (`F.linear`), or, for a decode step's few rows on a
GPU, the weight-streaming Triton kernel where `skinny_linear.ENGINE_MAX_ROWS` allows it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparseengine.kernels import skinny_linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if x.is_cuda and 0 < rows <= skinny_linear.ENGINE_MAX_ROWS:
            return skinny_linear.skinny_linear_triton(x, self.weight, self.bias,
                                                      **skinny_linear.engine_tiles(self.out_features, x.dtype))
        return F.linear(x, self.weight, self.bias)
