"""The generic attention layer: rotate q and k and write this step's K/V (the provider
may fuse the two; a decode step's qkv projection may do both in its epilogue,
`project_and_attend`), ask the method runtime what to read, call the provider, hand any
scores back. It never names a sparse method."""

from __future__ import annotations

import torch
from torch import nn

from sparseengine.engine.step_context import get_step_context
from sparseengine.kernels import cuda_linear_rope


class Attention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, d], k/v [T, Hkv, d] (q and k not yet rotated; cos/sin [T, d]) -> [T, Hq, d]."""
        ctx = get_step_context()
        view = ctx.views[self.layer_id]
        k_cache, v_cache = ctx.kv_cache.layer(self.layer_id)
        q = ctx.provider.rotate_write_kv(q, k, v, cos, sin, k_cache, v_cache, view.slot_mapping)
        return self._attend(q, ctx, view, k_cache, v_cache)

    def takes_projection(self, x: torch.Tensor, proj: nn.Linear) -> bool:
        """Whether `project_and_attend` runs here: the qkv kernel with the rotary and KV write
        in its epilogue takes x and the layer (`cuda_linear_rope.takes`), and the provider
        writes the standard paged cache (a Triton-kernel provider)."""
        if proj.bias is not None or not cuda_linear_rope.takes(x, proj.weight, self.head_dim):  # off: returns first
            return False
        ctx = get_step_context()
        return ctx.provider.triton_kernels and ctx.views[self.layer_id].slot_mapping.dtype == torch.int64

    def project_and_attend(self, x: torch.Tensor, proj: nn.Linear, norm: nn.Module | None, cos: torch.Tensor,
                           sin: torch.Tensor) -> torch.Tensor:
        """`forward` from the layer's input: the qkv projection (`proj`, after the unit-weight
        RMSNorm `norm`) rotates q and k and writes k and v as it finishes -> [T, Hq, d]."""
        ctx = get_step_context()
        view = ctx.views[self.layer_id]
        k_cache, v_cache = ctx.kv_cache.layer(self.layer_id)
        q = cuda_linear_rope.qkv_rope(x, proj.weight, rms_eps=None if norm is None else norm.eps, cos=cos, sin=sin,
                                      k_cache=k_cache, v_cache=v_cache, slot_mapping=view.slot_mapping,
                                      num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
        return self._attend(q, ctx, view, k_cache, v_cache)

    def _attend(self, q, ctx, view, k_cache, v_cache) -> torch.Tensor:
        layer = self.layer_id
        selection = ctx.method.select(layer, q, ctx)
        block_mask = ctx.method.block_mask(layer, q, ctx)
        score_rows = ctx.method.score_rows(layer, ctx)
        extra = {} if block_mask is None else {"block_mask": block_mask}
        out, scores = ctx.provider.attend(q, k_cache, v_cache, ctx, view, selection, score_rows, **extra)
        if score_rows is not None:
            ctx.method.observe(layer, q, scores, ctx)
        return out
