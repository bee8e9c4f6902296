"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention
Sinks"): keep the first ``sink_tokens`` and the last ``recent_tokens``; evict the middle
as soon as a row grows past their sum. ``budget`` is unused.

``streamingllm_rerotate=False`` (reference variant): keys keep their original RoPE
positions. ``True`` (the paper's variant): positions are cache-local; after each eviction
the kept keys are re-rotated to their new cache index, and new tokens take the position
equal to their cache index.
"""

from __future__ import annotations

import torch

from sparseengine.layers.rotary import apply_rotary, rope_inv_freq
from sparseengine.method_registry import MethodSpec
from sparseengine.methods.base import SparseMethodRuntime
from sparseengine.methods.selection import streaming_keep


class StreamingLLM(SparseMethodRuntime):
    def __init__(self, config, model, cache) -> None:
        super().__init__(config, model, cache)
        self.rerotate = bool(self.knob("streamingllm_rerotate"))
        self.inv_freq = rope_inv_freq(model.head_dim, model.rope_theta, model.rope_scaling)

    @property
    def total(self) -> int:
        return self.config.sink_tokens + self.config.recent_tokens

    def cache_lens_after_prefill(self, n: int) -> list[int]:
        return [min(n, self.total)] * self.model.num_layers

    def max_cache_tokens(self, n: int, output_tokens: int) -> int:
        return min(n + output_tokens, self.total + 1)

    def positions(self, seq, start, n):
        if not self.rerotate:
            return range(start, start + n)
        local = seq.num_cached_tokens  # every layer holds the same count
        return range(local, local + n)

    def finish_step(self, batch) -> None:
        for seq in batch.seqs:
            n = seq.layer_lens[0]
            if n <= self.total:
                continue
            keep = streaming_keep(n, self.config.sink_tokens, self.config.recent_tokens)
            heads = keep.expand(self.model.num_kv_heads, -1)
            for layer in range(self.model.num_layers):
                self.cache.compact(seq, layer, heads)
                if self.rerotate:
                    self._rerotate(seq, layer, keep)
            self.cache.trim_pages(seq)

    def _rerotate(self, seq, layer: int, kept: torch.Tensor) -> None:
        """Move each kept key from position kept[i] to position i: rotate by i - kept[i]."""
        delta = torch.arange(kept.numel()) - kept
        moved = delta != 0
        if not moved.any():
            return
        idx = torch.nonzero(moved).flatten()
        k_cache, _ = self.cache.kv.layer(layer)
        flat = k_cache.flatten(0, 1)
        slots = self.cache.slots(seq, idx.to(flat.device))
        freqs = delta[idx].double()[:, None] * self.inv_freq.double()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(flat.device, flat.dtype), emb.sin().to(flat.device, flat.dtype)
        flat[slots] = apply_rotary(flat[slots], cos, sin)

    def kv_tokens(self, seq) -> float:
        return float(seq.layer_lens[0])


SPEC = MethodSpec(
    name="streamingllm", kind="decode", family="physical_eviction", runtime=StreamingLLM,
    prefill_policy="all_chunked", frees_memory=True, knobs={"streamingllm_rerotate": False},
    budget_knob="recent_tokens",  # a total budget T is T - sink recent tokens
    paper="Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024")
