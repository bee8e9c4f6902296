"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention
Sinks"): keep the first ``sink_tokens`` and the last ``recent_tokens``; evict the middle
as soon as a row grows past their sum. ``budget`` is unused.

The cache holds the kept tokens as ``[sink | recent window]``. With original positions
(the default) attention does not care about slot order, so when one token arrives in a
full row (every decode step) it takes the slot of the oldest recent token: the window is
a ring, and a step moves one token per layer instead of shifting the whole window. Any
other eviction (a prompt chunk) compacts every layer at once back into token order.

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

RING_KEY = "streaming_ring"  # where the recent window's oldest token sits (see finish_step)


def token_order(n: int, sink: int, recent: int, ring: int) -> torch.Tensor:
    """Cache indices of an n-token row (n >= sink + recent when ``ring`` > 0) in token
    order: the recent window ``[sink, sink + recent)`` is a ring whose oldest token sits
    at ``sink + ring``; indices past it hold the step's new tokens, in order."""
    order = torch.arange(n)
    if ring:
        order[sink:sink + recent] = sink + (ring + torch.arange(recent)) % recent
    return order


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
        sink, recent = self.config.sink_tokens, self.config.recent_tokens
        src, dst = [], []  # one token per request moves (every layer) on the ring path
        compacted = []  # rows that dropped tokens wholesale: their pages past the room return
        for seq in batch.seqs:
            n = seq.layer_lens[0]
            if n <= self.total:
                continue
            st = self.cache.state(seq)
            ring = st.get(RING_KEY, 0)
            if n == self.total + 1 and recent > 0 and not self.rerotate:
                # the newest token (slot `total`) takes the oldest recent token's slot
                src.append(self.cache.slot(seq, self.total))
                dst.append(self.cache.slot(seq, sink + ring))
                st[RING_KEY] = (ring + 1) % recent
                seq.layer_lens = [self.total] * len(seq.layer_lens)
            else:
                kept = streaming_keep(n, sink, recent)  # token indices; cache indices below
                self.cache.compact_layers(seq, token_order(n, sink, recent, ring)[kept].expand(
                    self.model.num_kv_heads, -1))
                st[RING_KEY] = 0
                if self.rerotate:  # never on the ring: token index = cache index here
                    self._rerotate(seq, kept)
                compacted.append(seq)
        if src:
            self.cache.move_tokens(self.cache.upload(src), self.cache.upload(dst))
        # A ring row holds total + 1 tokens at most, so its pages never pass the room kept
        # for the next token (nothing to trim, every step). Compacted rows, after the moves:
        for seq in compacted:
            self.cache.trim_pages(seq, room=self.total + 1)  # room for the next token: no page churn

    def _rerotate(self, seq, kept: torch.Tensor) -> None:
        """Move each kept key (every layer) from position kept[i] to position i: rotate by
        i - kept[i]."""
        delta = torch.arange(kept.numel()) - kept
        idx = torch.nonzero(delta != 0).flatten()
        if idx.numel() == 0:
            return
        kv = self.cache.kv
        flat, layers = kv.k_rows, kv.num_layers
        slots = self.cache.flat(range(layers), self.cache.slots(seq, idx.to(flat.device))[None, :]).flatten()
        freqs = delta[idx].double()[:, None] * self.inv_freq.double()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(flat.device, flat.dtype), emb.sin().to(flat.device, flat.dtype)
        cos, sin = cos.repeat(layers, 1), sin.repeat(layers, 1)  # the same rotation in every layer
        flat[slots] = apply_rotary(flat[slots], cos, sin)

    def kv_tokens(self, seq) -> float:
        return float(seq.layer_lens[0])


SPEC = MethodSpec(
    name="streamingllm", kind="decode", family="physical_eviction", runtime=StreamingLLM,
    prefill_policy="all_chunked", frees_memory=True, knobs={"streamingllm_rerotate": False},
    budget_knob="recent_tokens",  # a total budget T is T - sink recent tokens
    paper="Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024")
