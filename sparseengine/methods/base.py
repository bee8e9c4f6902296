"""The sparse-method runtime interface: per-step logic behind generic attention.

The engine calls these hooks and never asks which method it runs:
- ``begin_step(ctx)``: once per step, before the forward.
- ``graph_capturable()``: whether pure-decode hooks may be captured in a CUDA graph.
- ``graph_key(seqs)``: else, a key of the per-request state such a step bakes in (a graph
  per key), or None.
- ``positions(seq, start, n)``: RoPE positions of the step's new tokens (default: logical).
- ``select(layer, q, ctx)``: the cache tokens each (request, KV head) may read, or None.
- ``block_mask(layer, q, ctx)``: block-sparse causal attention for prefill rows, or None.
- ``score_rows(layer, ctx)``: which query rows must report column sums, or None.
- ``observe(layer, q, colsums, ctx)``: receives those column sums.
- ``finish_step(batch)``: evictions and compactions after the step; pages that no layer
  needs go back to the pool through ``cache.trim_pages``.
- ``release(seq)``: the request finished or was preempted; drop its state.
- ``cache_tokens_needed(n)``: the most cache slots a prompt of n tokens ever needs.
- ``narrow_layers`` / ``narrow_tokens(n)`` / ``narrow_bound(seq)``: layers that, once a
  request is compressed, hold only its first few cache indices while the others hold every
  token (DeltaKV's sparse layers): the engine then gives them pages only in the pool's
  narrow tier (``KVCache``), and the rest of the request's pages come from the wide tier.
Persistent per-request state (scores, page metadata, latents) lives in the cache
manager's per-request ``state(seq)`` dict.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sparseengine.config import Config
    from sparseengine.engine.cache_manager import CacheManager
    from sparseengine.engine.scheduler import ScheduledBatch
    from sparseengine.engine.sequence import Sequence
    from sparseengine.engine.step_context import BlockMask, ScoreRows, Selection, StepContext
    from sparseengine.models.model_config import ModelConfig


class SparseMethodRuntime:
    """Dense attention: the base every method refines."""

    def __init__(self, config: "Config", model: "ModelConfig", cache: "CacheManager") -> None:
        self.config = config
        self.model = model
        self.cache = cache
        self.prefill_ending: list["Sequence"] = []  # requests whose prefill ends this step
        self.decoding: list["Sequence"] = []  # requests that feed one decode token this step

    @classmethod
    def bytes_per_pool_page(cls, config: "Config", model: "ModelConfig", elem_bytes: int) -> int:
        """Method state the runtime keeps per KV-pool page (all layers), e.g. Quest's page
        bounds: the engine counts it when it sizes the pool."""
        return 0

    @classmethod
    def narrow_layers(cls, config: "Config", model: "ModelConfig") -> tuple[int, ...]:
        """Layers whose cache, once a request is compressed, holds at most ``narrow_tokens``
        of its cache indices (the rest of its pages need not exist in them); () for none."""
        return ()

    @classmethod
    def bytes_per_wide_page(cls, config: "Config", model: "ModelConfig", elem_bytes: int) -> int:
        """Memory the runtime keeps per token page a wide-tier page stands for (e.g. a
        codec's bytes for those tokens), outside the pool: the engine reserves it when it
        sizes the pool's tiers."""
        return 0

    @classmethod
    def narrow_tokens(cls, config: "Config", model: "ModelConfig", prompt_tokens: int) -> int | None:
        """The most cache indices the narrow layers hold of a request with this prompt
        once its prefill has ended; None: all of them (it is never compressed)."""
        return None

    def narrow_bound(self, seq: "Sequence") -> int | None:
        """``narrow_tokens`` of this request as it stands now (None until it is compressed)."""
        return None

    def knob(self, name: str) -> Any:
        return self.config.knob(name)

    @property
    def total(self) -> int:
        return self.config.sink_tokens + self.config.budget + self.config.recent_tokens

    def begin_step(self, ctx: "StepContext") -> None:
        self.prefill_ending = [s for s, n in zip(ctx.seqs, ctx.q_lens)
                               if not s.is_decoding and s.num_computed_tokens + n == s.num_tokens]
        self.decoding = [s for s in ctx.seqs if s.is_decoding]

    def wants_forward_hooks(self, seqs: list["Sequence"]) -> bool:
        """Does a pure-decode step of these requests need select/score_rows/observe inside
        the forward? If not, it may replay a CUDA graph. Default: yes when the method
        overrides either hook."""
        cls = type(self)
        return cls.select is not SparseMethodRuntime.select or cls.score_rows is not SparseMethodRuntime.score_rows

    def graph_capturable(self) -> bool:
        """True: for pure-decode steps, ``select`` and ``score_rows`` use tensors only (no
        host sync, no ``ctx.seqs``, which a capture fills with None; shapes fixed by the
        config and the page-table width), so the decode CUDA graph may capture them."""
        return False

    def begin_step_graph(self, seqs: list["Sequence"]) -> None:
        """``begin_step`` for a pure-decode step that replays a CUDA graph."""
        self.prefill_ending = []
        self.decoding = list(seqs)

    def graph_key(self, seqs: list["Sequence"]) -> Any:
        """For a method whose pure-decode hooks are not ``graph_capturable`` because they
        read per-request host state (Python objects, tensors of their own): a hashable key
        of everything such a step bakes in, or None (run eager). The runner then captures a
        graph for these requests (``seqs`` in the capture's context, padding rows None),
        replays it while the key stays the same, and captures again when it changes."""
        return None

    def positions(self, seq: "Sequence", start: int, n: int) -> range:
        return range(start, start + n)

    def select(self, layer: int, q: torch.Tensor, ctx: "StepContext") -> "Selection | None":
        return None

    def block_mask(self, layer: int, q: torch.Tensor, ctx: "StepContext") -> "BlockMask | None":
        return None

    def score_rows(self, layer: int, ctx: "StepContext") -> "ScoreRows | None":
        return None

    def observe(self, layer: int, q: torch.Tensor, colsums: list[torch.Tensor], ctx: "StepContext") -> None:
        pass

    def finish_step(self, batch: "ScheduledBatch") -> None:
        pass

    def release(self, seq: "Sequence") -> None:
        pass

    def cache_tokens_needed(self, prompt_tokens: int) -> int:
        return prompt_tokens

    def cache_lens_after_prefill(self, prompt_tokens: int) -> list[int]:
        """Tokens each layer holds right after a real prefill of this many tokens: what a
        synthesised prefill (decode benchmarks) must reproduce."""
        return [prompt_tokens] * self.model.num_layers

    def max_cache_tokens(self, prompt_tokens: int, output_tokens: int) -> int:
        """The most tokens any layer holds while generating: pages one request needs."""
        return max(self.cache_lens_after_prefill(prompt_tokens)) + output_tokens

    def init_synthetic(self, seq: "Sequence") -> None:
        """Per-request state a real prefill would have left (e.g. accumulated scores)."""

    def tokens_read(self, seq: "Sequence") -> list[int]:
        """Cache tokens one decode step reads per layer (and KV head): the roofline's KV term."""
        return list(seq.layer_lens)

    def metadata_bytes_read(self, seq: "Sequence", kv_bytes_per_token_layer: int) -> int:
        """Bytes of method metadata one decode step reads (page bounds, scores...)."""
        return 0

    def kv_tokens(self, seq: "Sequence") -> float:
        """Tokens held per layer and KV head (mean over layers)."""
        return sum(seq.layer_lens) / max(1, len(seq.layer_lens))

    def kernels(self, device: torch.device, provider: "AttentionProvider") -> dict[str, str]:
        """Which implementation runs each of the method's own ops (not the provider's attention)
        on `device` beside `provider` (for the records): {op: implementation}."""
        return {}


class MethodStack(SparseMethodRuntime):
    """A prefill-side runtime and a decode runtime behind one interface. The prefill-side
    one acts first; the first selection wins; score requests merge (most rows)."""

    def __init__(self, prefill: SparseMethodRuntime, decode: SparseMethodRuntime) -> None:
        super().__init__(decode.config, decode.model, decode.cache)
        self.parts = (prefill, decode)

    def begin_step(self, ctx):
        for p in self.parts:
            p.begin_step(ctx)

    def positions(self, seq, start, n):
        return self.parts[1].positions(seq, start, n)

    def wants_forward_hooks(self, seqs):
        return any(p.wants_forward_hooks(seqs) for p in self.parts)

    def graph_capturable(self):
        """Every part is capturable or asks for no hooks in a pure-decode step."""
        return all(p.graph_capturable() or not p.wants_forward_hooks([]) for p in self.parts)

    def begin_step_graph(self, seqs):
        for p in self.parts:
            p.begin_step_graph(seqs)

    def graph_key(self, seqs):
        """Every part is capturable, asks for no hooks, or gives a key (else None)."""
        keys = []
        for p in self.parts:
            if p.graph_capturable() or not p.wants_forward_hooks(seqs):
                keys.append(None)
                continue
            key = p.graph_key(seqs)
            if key is None:
                return None
            keys.append(key)
        return tuple(keys)

    def select(self, layer, q, ctx):
        for p in self.parts:
            sel = p.select(layer, q, ctx)
            if sel is not None:
                return sel
        return None

    def block_mask(self, layer, q, ctx):
        for p in self.parts:
            mask = p.block_mask(layer, q, ctx)
            if mask is not None:
                return mask
        return None

    def score_rows(self, layer, ctx):
        from sparseengine.engine.step_context import ScoreRows

        asks = [r for r in (p.score_rows(layer, ctx) for p in self.parts) if r is not None]
        if not asks:
            return None
        kinds = {a.kind for a in asks}
        if len(kinds) > 1:
            raise ValueError(f"layer {layer}: the stacked methods ask for different score kinds {sorted(kinds)}")
        bounds = [a.max_kv_len for a in asks]
        return ScoreRows(tuple(max(col) for col in zip(*(a.rows for a in asks))),
                         max_kv_len=None if None in bounds else max(bounds), kind=kinds.pop())

    def observe(self, layer, q, colsums, ctx):
        for p in self.parts:
            if p.score_rows(layer, ctx) is not None:
                p.observe(layer, q, colsums, ctx)

    def finish_step(self, batch):
        for p in self.parts:
            p.finish_step(batch)

    def release(self, seq):
        for p in self.parts:
            p.release(seq)

    def cache_tokens_needed(self, prompt_tokens):
        return min(p.cache_tokens_needed(prompt_tokens) for p in self.parts)

    def kv_tokens(self, seq):
        return self.parts[1].kv_tokens(seq)

    def cache_lens_after_prefill(self, prompt_tokens):
        a, b = (p.cache_lens_after_prefill(prompt_tokens) for p in self.parts)
        return [min(x, y) for x, y in zip(a, b)]

    def tokens_read(self, seq):
        return self.parts[1].tokens_read(seq)

    def metadata_bytes_read(self, seq, kv_bytes_per_token_layer):
        return self.parts[1].metadata_bytes_read(seq, kv_bytes_per_token_layer)

    def kernels(self, device, provider):
        return {**self.parts[0].kernels(device, provider), **self.parts[1].kernels(device, provider)}

    def max_cache_tokens(self, prompt_tokens, output_tokens):
        return min(p.max_cache_tokens(prompt_tokens, output_tokens) for p in self.parts)

    def init_synthetic(self, seq):
        self.parts[1].init_synthetic(seq)

    def narrow_bound(self, seq):
        return self.parts[1].narrow_bound(seq)
