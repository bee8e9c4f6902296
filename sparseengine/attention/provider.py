"""The provider interface and the choice by capability (recorded, never silent)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparseengine.config import ConfigError

if TYPE_CHECKING:
    from sparseengine.engine.step_context import BlockMask, LayerView, ScoreRows, Selection, StepContext


class AttentionProvider:
    name = "base"

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: "StepContext",
               view: "LayerView", selection: "Selection | None",
               score_rows: "ScoreRows | None", block_mask: "BlockMask | None" = None,
               ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """-> (out [T, Hq, d], per request [Hkv, kv_len] column sums, or None). ``block_mask``
        (passed only when a method asks for one): block-sparse causal prefill rows."""
        raise NotImplementedError


def make_provider(name: str, device: torch.device) -> AttentionProvider:
    """``auto``: Triton on CUDA, the torch reference on CPU. An explicit choice that the
    device cannot run is an error, never a silent fallback."""
    import os

    from sparseengine.attention.torch_ref import TorchAttentionProvider

    if name in ("auto", "torch") and (name == "torch" or device.type == "cpu"):
        return TorchAttentionProvider()
    if name == "auto":
        name = "triton"
    interpreted = name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ConfigError(f"attention_provider={name!r} needs a CUDA device (Triton also runs on CPU under "
                          "TRITON_INTERPRET=1); on CPU use 'torch' or 'auto'")
    if name == "triton":
        from sparseengine.attention.triton_provider import TritonAttentionProvider
        return TritonAttentionProvider()
    if name == "flashinfer":
        from sparseengine.attention.flashinfer_provider import FlashInferAttentionProvider
        return FlashInferAttentionProvider()
    raise ConfigError(f"Unknown attention_provider={name!r}; valid: auto, torch, triton, flashinfer")
