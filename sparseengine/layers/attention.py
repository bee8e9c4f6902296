"""The generic attention layer: rotate q and k and write this step's K/V (the provider
may fuse the two), ask the method runtime what to read, call the provider, hand any
scores back. It never names a sparse method."""

from __future__ import annotations

import torch
from torch import nn

from sparseengine.engine.step_context import get_step_context


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
        layer = self.layer_id
        view = ctx.views[layer]
        k_cache, v_cache = ctx.kv_cache.layer(layer)
        q = ctx.provider.rotate_write_kv(q, k, v, cos, sin, k_cache, v_cache, view.slot_mapping)
        selection = ctx.method.select(layer, q, ctx)
        block_mask = ctx.method.block_mask(layer, q, ctx)
        score_rows = ctx.method.score_rows(layer, ctx)
        extra = {} if block_mask is None else {"block_mask": block_mask}
        out, scores = ctx.provider.attend(q, k_cache, v_cache, ctx, view, selection, score_rows, **extra)
        if score_rows is not None:
            ctx.method.observe(layer, q, scores, ctx)
        return out
