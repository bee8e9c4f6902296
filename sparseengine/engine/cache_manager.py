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

    def compact_layers(self, seq: Sequence, keep: torch.Tensor, layers: list[int] | None = None) -> None:
        """``compact`` of many layers at once (one gather, one scatter for K and for V):
        ``keep [Hkv, count]`` (the same cache indices in every layer) or ``[len(layers),
        Hkv, count]``; ``layers`` defaults to all."""
        kv, ps = self.kv, self.page_size
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
        offset = torch.tensor(layers, device=device)[:, None, None] * (kv.num_pages * ps)  # [nl, 1, 1]
        src = self.slots(seq, keep) + offset  # [nl, Hkv, count]
        dst = (self.slots(seq, torch.arange(count, device=device)) + offset).expand(nl, hkv, count)
        heads = torch.arange(hkv, device=device)[None, :, None]
        for cache in (kv.k, kv.v):
            flat = cache.view(-1, *cache.shape[3:])  # [L * pages * page, Hkv, d]
            flat[dst, heads] = flat[src, heads]
        for layer in layers:
            seq.layer_lens[layer] = count

    def move_tokens(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K and V (all heads) of the physical cache slots ``src [N]``
        to the slots ``dst [N]`` (one gather and one scatter, whatever the batch)."""
        kv = self.kv
        device = kv.k.device
        offset = torch.arange(kv.k.shape[0], device=device)[:, None] * (kv.num_pages * self.page_size)
        src, dst = src.to(device)[None, :] + offset, dst.to(device)[None, :] + offset  # [L, N]
        for cache in (kv.k, kv.v):
            flat = cache.view(-1, *cache.shape[3:])
            flat[dst.flatten()] = flat[src.flatten()]

    def trim_pages(self, seq: Sequence) -> int:
        return self.scheduler.trim_pages(seq)
