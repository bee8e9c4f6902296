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

    def slot(self, seq: Sequence, index: int) -> int:
        """``slots`` of one index, in Python (no tensor): per-request bookkeeping."""
        return seq.page_table[index // self.page_size] * self.page_size + index % self.page_size

    @staticmethod
    def rows(cache: torch.Tensor) -> torch.Tensor:
        """The pool ``[L, pages, page, Hkv, d]`` as ``[L * pages * page, Hkv, d]`` (a view)."""
        return cache.view(-1, *cache.shape[3:])

    def flat(self, layers, slots: torch.Tensor) -> torch.Tensor:
        """Indices into ``rows(...)`` of physical ``slots`` in ``layers [nl]``: ``slots``
        has a leading dim of nl or 1, and the result ``[nl, ...]``."""
        layers = torch.as_tensor(list(layers), device=slots.device)
        return layers.view(-1, *([1] * (slots.dim() - 1))) * (self.kv.num_pages * self.page_size) + slots

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
        self.compact_layers(seq, keep, [layer])

    def compact_layers(self, seq: Sequence, keep: torch.Tensor, layers: list[int] | None = None) -> None:
        """``compact`` of many layers at once (one gather, one scatter for K and for V):
        ``keep [Hkv, count]`` (the same cache indices in every layer) or ``[len(layers),
        Hkv, count]``; ``layers`` defaults to all."""
        kv = self.kv
        layers = list(range(kv.k.shape[0])) if layers is None else list(layers)
        if not layers:
            return
        device = kv.k.device
        keep = keep.to(device)
        if keep.dim() == 2:
            keep = keep.expand(len(layers), *keep.shape)
        nl, hkv, count = keep.shape
        if nl != len(layers) or hkv != kv.k.shape[3]:
            raise ValueError(f"keep must be [Hkv={kv.k.shape[3]}, count] or [{len(layers)}, Hkv, count], "
                             f"got {tuple(keep.shape)}")
        src = self.flat(layers, self.slots(seq, keep))  # [nl, Hkv, count]
        dst = self.flat(layers, self.slots(seq, torch.arange(count, device=device))[None, None]).expand(nl, hkv, count)
        heads = torch.arange(hkv, device=device)[None, :, None]
        for cache in (kv.k, kv.v):
            flat = self.rows(cache)
            flat[dst, heads] = flat[src, heads]
        for layer in layers:
            seq.layer_lens[layer] = count

    def move_tokens(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K and V (all heads) of the physical cache slots ``src [N]``
        to the slots ``dst [N]`` (one gather and one scatter, whatever the batch)."""
        device, layers = self.kv.k.device, range(self.kv.k.shape[0])
        src, dst = (self.flat(layers, t.to(device)[None, :]).flatten() for t in (src, dst))  # [L * N]
        for cache in (self.kv.k, self.kv.v):
            flat = self.rows(cache)
            flat[dst] = flat[src]

    def trim_pages(self, seq: Sequence) -> int:
        return self.scheduler.trim_pages(seq)
