"""Persistent cache state: the paged KV tensors, per-token method state that lives beside
them (``token_pool``), per-request method state, and the compaction and token moves that
let eviction methods return whole pages to the pool. Every move of a token's K/V moves
its entries in every token pool too, so method state never falls out of step with the
cache, whoever moves the token."""

from __future__ import annotations

from typing import Any

import torch

from sparseengine.engine.kv_cache import KVCache
from sparseengine.engine.scheduler import Scheduler
from sparseengine.engine.sequence import Sequence

MOVE_CHUNK_PAGES = 1024  # move_to_wide's pages a copy (a 128K request's wide layers: 8 copies)


class CacheManager:
    def __init__(self, kv: KVCache, scheduler: Scheduler) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.page_size = kv.page_size
        self._state: dict[int, dict[str, Any]] = {}
        self._pools: dict[str, torch.Tensor] = {}

    def token_pool(self, name: str, dtype: torch.dtype, fill=0) -> torch.Tensor:
        """A per-(layer, token slot, KV head) tensor ``[L, pages, page, Hkv]`` beside the KV
        pool (made on first use, filled with ``fill``), e.g. H2O's accumulated scores: it
        shares the KV pool's slot indexing (``rows``, ``flat``) and travels with every
        compaction and token move."""
        pool = self._pools.get(name)
        if pool is None:
            if not self.kv.uniform:
                raise ValueError(f"token pool {name!r}: a pool with narrow layers keeps no token pools")
            with torch.inference_mode(False):  # a normal tensor, like the KV pool: moves run outside the forward
                pool = torch.full(self.kv.k.shape[:4], fill, dtype=dtype, device=self.kv.k.device)
            self._pools[name] = pool
        return pool

    def _tensors(self) -> list[torch.Tensor]:
        """Everything a token move carries, as rows (``rows``): K, V and every token pool."""
        return [self.kv.k_rows, self.kv.v_rows, *(self.rows(p) for p in self._pools.values())]

    def state(self, seq: Sequence) -> dict[str, Any]:
        """Per-request method state (scores, page metadata, latents, ...)."""
        return self._state.setdefault(seq.seq_id, {})

    def drop(self, seq: Sequence) -> None:
        self._state.pop(seq.seq_id, None)

    def upload(self, data, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Host data (a list or numpy array) as a tensor on the pool's device, sent from
        pinned memory without waiting: a plain copy of pageable memory first waits for all
        the work already queued (the step's graph), so a method's bookkeeping after a step
        would no longer overlap it."""
        t = torch.as_tensor(data, dtype=dtype)
        device = self.kv.device
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

    def slots(self, seq: Sequence, positions: torch.Tensor) -> torch.Tensor:
        """Cache slots of the given logical cache indices (any shape)."""
        table = self.upload(seq.page_table).to(positions.device)  # no wait on the queued work
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    def slot(self, seq: Sequence, index: int) -> int:
        """``slots`` of one index, in Python (no tensor): per-request bookkeeping."""
        return seq.page_table[index // self.page_size] * self.page_size + index % self.page_size

    @staticmethod
    def rows(cache: torch.Tensor) -> torch.Tensor:
        """A token pool ``[L, pages, page, Hkv]`` as ``[L * pages * page, Hkv]`` (a view);
        the KV pool's rows are ``kv.k_rows`` and ``kv.v_rows``."""
        return cache.view(-1, *cache.shape[3:])

    def flat(self, layers, slots: torch.Tensor) -> torch.Tensor:
        """Indices into the token rows (``kv.k_rows``, ``rows(pool)``) of physical ``slots``
        in ``layers [nl]``: ``slots`` has a leading dim of nl or 1, and the result ``[nl, ...]``."""
        layers = layers if isinstance(layers, torch.Tensor) else self.upload(list(layers))
        offsets = self.kv.offsets()[layers.to(self.kv.device)].to(slots.device)
        return offsets.view(-1, *([1] * (slots.dim() - 1))) + slots

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
        """``compact`` of many layers at once (one gather, one scatter for K, V and each pool):
        ``keep [Hkv, count]`` (the same cache indices in every layer) or ``[len(layers),
        Hkv, count]``; ``layers`` defaults to all."""
        kv = self.kv
        layers = list(range(kv.num_layers)) if layers is None else list(layers)
        if not layers:
            return
        device = kv.device
        keep = keep.to(device)
        if keep.dim() == 2:
            keep = keep.expand(len(layers), *keep.shape)
        nl, hkv, count = keep.shape
        if nl != len(layers) or hkv != kv.num_kv_heads:
            raise ValueError(f"keep must be [Hkv={kv.num_kv_heads}, count] or [{len(layers)}, Hkv, count], "
                             f"got {tuple(keep.shape)}")
        src = self.flat(layers, self.slots(seq, keep))  # [nl, Hkv, count]
        dst = self.flat(layers, self.slots(seq, torch.arange(count, device=device))[None, None]).expand(nl, hkv, count)
        self.move_entries(src, dst, torch.arange(hkv, device=device)[None, :, None])
        for layer in layers:
            seq.layer_lens[layer] = count

    def compact_tokens(self, seq: Sequence, keep: torch.Tensor, layers: list[int], start: int) -> None:
        """Keep the cached tokens below ``start`` where they are and the tokens ``keep [count]``
        (the same indices for every KV head, sorted) after them, at ``start ...``, in
        ``layers``: whole rows move (``move_tokens``), and only those that move."""
        keep = keep.to(self.kv.device)
        dst = torch.arange(start, start + keep.numel(), device=keep.device)
        self.move_tokens(self.slots(seq, keep), self.slots(seq, dst), layers)
        for layer in layers:
            seq.layer_lens[layer] = start + keep.numel()

    def move_tokens(self, src: torch.Tensor, dst: torch.Tensor, layers: list[int] | None = None) -> None:
        """Copy the K and V (all heads, and the token pools) of the physical cache slots
        ``src [N]`` to the slots ``dst [N]`` in ``layers`` (default: all), one gather and one
        scatter whatever the batch; every source is read before any write."""
        device = self.kv.device
        layers = range(self.kv.num_layers) if layers is None else layers
        if not len(layers):
            return
        src, dst = (self.flat(layers, t.to(device)[None, :]).flatten() for t in (src, dst))  # [L * N]
        for flat in self._tensors():
            flat[dst] = flat[src]

    def move_entries(self, src: torch.Tensor, dst: torch.Tensor, heads: torch.Tensor) -> None:
        """Per KV head moves: entry ``(src[i], heads[i])`` of ``rows(...)`` (``flat``
        indices) goes to ``(dst[i], heads[i])``, in K, V and every token pool; the shapes
        broadcast. Every source is read before any write; two moves into one destination
        must carry the same token."""
        for flat in self._tensors():
            flat[dst, heads] = flat[src, heads]

    def evict_to(self, table: torch.Tensor, layers, victims: torch.Tensor, total: int) -> None:
        """Rows of G requests (page tables ``table [G, P]``) in ``layers [nl]``, each holding
        ``n = total + k`` tokens per KV head, drop the cache indices ``victims [G, nl, Hkv,
        k]`` (distinct per row). The kept tokens at indices ``>= total`` move into the freed
        indices below it, so every row ends with its kept tokens at ``[0, total)`` in no
        particular order; at most ``min(k, total)`` tokens move per row (no compaction)."""
        g, nl, hkv, k = victims.shape
        device = victims.device
        n, m = total + k, min(k, total)
        if k == 1:  # a decode step: the newest token takes the victim's slot (a self-copy if it is the victim)
            src, dst = torch.full_like(victims, total), victims
        else:
            none = n  # sorts after every cache index
            freed = torch.where(victims < total, victims, none).sort(dim=-1).values[..., :m]
            dropped = torch.zeros_like(victims).scatter_add_(-1, (victims - total).clamp(min=0),
                                                             (victims >= total).long())
            tail = torch.arange(total, n, device=device).expand_as(victims)
            kept_tail = torch.where(dropped > 0, none, tail).sort(dim=-1).values[..., :m]
            moves = freed < none  # as many freed indices below total as kept tokens past it
            spare = torch.arange(total, total + m, device=device).expand_as(freed)  # unused: a self-copy past the row
            src, dst = torch.where(moves, kept_tail, spare), torch.where(moves, freed, spare)
        ps = self.page_size
        rows = torch.arange(g, device=device)[:, None, None, None]
        table = table.to(device).long()
        src, dst = ((table[rows, i // ps] * ps + i % ps).flatten(1) for i in (src, dst))  # [G, nl * Hkv * m]
        src, dst = (self.flat(layers, t.view(g, nl, hkv * m).transpose(0, 1)) for t in (src, dst))
        heads = torch.arange(hkv, device=device).repeat_interleave(m).view(1, 1, hkv * m)
        self.move_entries(src, dst, heads)

    def trim_pages(self, seq: Sequence, room: int = 0) -> int:
        return self.scheduler.trim_pages(seq, room)

    def move_to_wide(self, seq: Sequence, first_page: int) -> int:
        """A pool with narrow layers: the request's logical pages from ``first_page`` on
        that sit in the narrow tier, and that no narrow layer of it reads any more (the
        caller's promise: a compressed request's narrow layers end before ``first_page``),
        move to wide-tier pages as far as the tier has room: the wide layers' K and V
        copied, the page table updated, the narrow pages freed. Returns the pages moved."""
        alloc = self.scheduler.allocator
        if self.kv.uniform:
            return 0
        at = [i for i in range(first_page, len(seq.page_table)) if alloc.is_narrow(seq.page_table[i])]
        new = alloc.take_wide(len(at))
        if not new:
            return 0
        at = at[: len(new)]
        old = [seq.page_table[i] for i in at]
        ps, device = self.page_size, self.kv.device
        within = torch.arange(ps, device=device)
        for c in range(0, len(new), MOVE_CHUNK_PAGES):  # bounds the gathered copy's memory
            src, dst = ((self.upload(p[c:c + MOVE_CHUNK_PAGES])[:, None] * ps + within).flatten() for p in (old, new))
            self.move_tokens(src, dst, self.kv.wide_layers)
        for i, page in zip(at, new):
            seq.page_table[i] = page
        alloc.free(old)
        return len(new)
