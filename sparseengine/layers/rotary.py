"""Rotary position embedding (rotate-half convention), with llama3 and linear scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from sparseengine.kernels.fused_ops import rotary_ref
from sparseengine.models.model_config import ModelConfig


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d]; cos/sin [T, d]: `x * cos + rotate_half(x) * sin` in torch. The model
    rotates q and k with `fused_ops.rotary_qk` (one kernel on CUDA, this on CPU)."""
    return rotary_ref(x, cos, sin)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.table: torch.Tensor | None = None  # [positions, 2 * d]: cos then sin (`reserve`)

    def reserve(self, num_positions: int, dtype: torch.dtype) -> None:
        """Compute cos/sin of positions [0, num_positions) in `dtype` once: `cos_sin` then
        gathers a step's rows (one launch) instead of computing them (six: the product,
        the concatenation, cos, sin and two casts; ~12 us a decode step on the H200). The
        same elementwise ops, so the same values. Positions past the table are the
        caller's error (the engine reserves max_model_len)."""
        cos, sin = self._compute(torch.arange(num_positions, device=self.inv_freq.device), dtype)
        self.table = torch.cat((cos, sin), dim=-1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, d] in `dtype` (from the reserved table where it is
        of `dtype` and on positions' device)."""
        table = self.table
        if table is None or table.dtype != dtype or table.device != positions.device:
            return self._compute(positions, dtype)
        rows = table.index_select(0, positions)
        half = table.shape[1] // 2
        return rows[:, :half], rows[:, half:]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
