"""Persistent cache state: the paged KV tensors, per-request method state, and the
compaction that lets eviction methods return whole pages to the pool."""

from __future__ import annotations

from typing import Any

import torch

from sparseengine.engine.kv_cache import KVCache
from sparseengine.engine.scheduler import Scheduler
from sparseengine.engine.sequence import Sequence


class CacheManager:
    def __init__(self, kv: KVCache, scheduler: Scheduler) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.page_size = kv.page_size
        self._state: dict[int, dict[str, Any]] = {}

    def state(self, seq: Sequence) -> dict[str, Any]:
        """Per-request method state (scores, page metadata, latents, ...)."""
        return self._state.setdefault(seq.seq_id, {})

    def drop(self, seq: Sequence) -> None:
        self._state.pop(seq.seq_id, None)

    def slots(self, seq: Sequence, positions: torch.Tensor) -> torch.Tensor:
        """Cache slots of the given logical cache indices (any shape)."""
        table = torch.tensor(seq.page_table, dtype=torch.long, device=positions.device)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    def gather(self, seq: Sequence, layer: int, length: int | None = None,
               start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n, Hkv, d] of a request's cached tokens ``start..length-1`` in one layer."""
        n = seq.layer_lens[layer] if length is None else length
        k_cache, v_cache = self.kv.layer(layer)
        slots = self.slots(seq, torch.arange(start, n, device=k_cache.device))
        return k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]

    def compact(self, seq: Sequence, layer: int, keep: torch.Tensor) -> None:
        """Keep, for each KV head h, the cached tokens ``keep[h]`` (sorted, same count for
        every head), written densely at the front of the layer's cache."""
        k_cache, v_cache = self.kv.layer(layer)
        kc, vc = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
        hkv, count = keep.shape
        src = self.slots(seq, keep.to(kc.device))  # [Hkv, count]
        dst = self.slots(seq, torch.arange(count, device=kc.device))  # [count]
        heads = torch.arange(hkv, device=kc.device)[:, None]
        k_new, v_new = kc[src, heads], vc[src, heads]  # [Hkv, count, d]
        kc[dst[None, :].expand(hkv, -1), heads] = k_new
        vc[dst[None, :].expand(hkv, -1), heads] = v_new
        seq.layer_lens[layer] = count

    def trim_pages(self, seq: Sequence) -> int:
        return self.scheduler.trim_pages(seq)
