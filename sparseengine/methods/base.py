"""The sparse-method runtime interface: per-step logic behind generic attention.

The engine calls these hooks and never asks which method it runs:
- ``select(layer, q, ctx)``: the cache tokens each (request, KV head) may read, or None.
- ``score_rows(layer, ctx)``: which query rows must report column sums, or None.
- ``observe(layer, q, colsums, ctx)``: receives those column sums.
- ``finish_step(batch)``: evictions and compactions after the step; pages that no layer
  needs go back to the pool through ``cache.trim_pages``.
- ``release(seq)``: the request finished or was preempted; drop its state.
Persistent per-request state (scores, page metadata, latents) lives in the
``MethodState`` the cache manager keeps for each request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sparseengine.config import Config
    from sparseengine.engine.cache_manager import CacheManager
    from sparseengine.engine.scheduler import ScheduledBatch
    from sparseengine.engine.sequence import Sequence
    from sparseengine.engine.step_context import ScoreRows, Selection, StepContext
    from sparseengine.models.model_config import ModelConfig


class SparseMethodRuntime:
    """Dense attention: the base every method refines."""

    def __init__(self, config: "Config", model: "ModelConfig", cache: "CacheManager") -> None:
        self.config = config
        self.model = model
        self.cache = cache

    def knob(self, name: str) -> Any:
        return self.config.knob(name)

    def begin_step(self, ctx: "StepContext") -> None:
        pass

    def select(self, layer: int, q: torch.Tensor, ctx: "StepContext") -> "Selection | None":
        return None

    def score_rows(self, layer: int, ctx: "StepContext") -> "ScoreRows | None":
        return None

    def observe(self, layer: int, q: torch.Tensor, colsums: list[torch.Tensor], ctx: "StepContext") -> None:
        pass

    def finish_step(self, batch: "ScheduledBatch") -> None:
        pass

    def release(self, seq: "Sequence") -> None:
        pass

    def kv_tokens(self, seq: "Sequence") -> float:
        """Tokens held per layer and KV head (mean over layers)."""
        return sum(seq.layer_lens) / max(1, len(seq.layer_lens))
