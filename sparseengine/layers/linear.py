"""The model's linear layers: cuBLAS (`F.linear`), or, for a decode step's few rows on a
GPU, the CUDA kernel (`cuda_linear`, 1-8 bf16 rows on an sm_90 GPU with nvcc) or else the
weight-streaming Triton kernel where `skinny_linear.ENGINE_MAX_ROWS` allows it.

`norm` and `residual` fold the RMSNorm before a layer (whose weight the model has folded
into this layer's, leaving the norm a unit weight) and the residual add after it into the
layer: into the kernel where one runs (`rms_eps` and `residual`), as the norm, the linear
and the add otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparseengine.kernels import cuda_linear, skinny_linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """`norm`: an RMSNorm of unit weight (`eps`) applied to x first; `residual`: added to the result."""
        eps = None if norm is None else norm.eps
        if cuda_linear.takes(x, self.weight, self.bias):
            return cuda_linear.cuda_linear(x, self.weight, rms_eps=eps, residual=residual)
        if skinny_linear.streams(x):
            return skinny_linear.skinny_linear_triton(
                x, self.weight, self.bias, rms_eps=eps, residual=residual,
                **skinny_linear.engine_tiles(self.out_features, x.dtype, x.device, x.numel() // x.shape[-1]))
        y = F.linear(x if norm is None else norm(x), self.weight, self.bias)
        return y if residual is None else y + residual
