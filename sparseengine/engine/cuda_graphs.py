"""Decode CUDA graphs over batch-size buckets (1, 2, 4, 8, then every 16).

A graph is captured lazily per bucket for pure-decode steps whose method asks for no
per-layer hooks in the forward, or whose hooks are graph-capturable (tensor-only; the
capture context has ``is_decode`` True and ``seqs = [None] * B``; the runner calls the
method's ``begin_step_graph`` before every replay and capture). Inputs live in static
buffers: token ids, positions, per-layer slot mappings and lengths, and a page table as
wide as ``max_model_len`` needs, so a replay never depends on the batch's lengths.
Padding rows write nowhere (slot -1) and read one token of page 0.
"""

from __future__ import annotations

import numpy as np
import torch

from sparseengine.engine.step_context import LayerView, StepContext, set_step_context


def buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model, kv_cache, provider, method, device, max_batch: int, max_pages: int) -> None:
        self.model, self.kv_cache, self.provider, self.method = model, kv_cache, provider, method
        self.device = device
        self.sizes = buckets(max_batch)
        top, layers = self.sizes[-1], model.config.num_layers
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((layers, top), -1, dtype=torch.long, device=device)
        self.lens = torch.ones((layers, top), dtype=torch.int32, device=device)
        self.table = torch.zeros((top, max_pages), dtype=torch.int32, device=device)
        self.cu = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        # host mirror of ``table`` (pinned: its rows go up without a staging copy); per row,
        # the (request id, page list) it holds, so a step re-sends only the rows that changed
        self._host = torch.zeros((top, max_pages), dtype=torch.int32)
        if torch.device(device).type == "cuda":
            self._host = self._host.pin_memory()
        self.host_table = self._host.numpy()  # the same memory, written row by row
        self._row_of: list[tuple[int, list[int]] | None] = [None] * top
        self._dirty: tuple[int, int] | None = None

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.sizes if b >= batch), None)

    def _context(self, size: int) -> StepContext:
        layers = self.model.config.num_layers
        views = [LayerView(self.slots[l, :size], self.lens[l, :size], (1,) * size, self.table[:size])
                 for l in range(layers)]
        return StepContext(seqs=[None] * size, q_lens=(1,) * size, cu_q_lens=self.cu[: size + 1], is_decode=True,
                           views=views, kv_cache=self.kv_cache, provider=self.provider, method=self.method,
                           positions=self.positions[:size])

    def _capture(self, size: int) -> None:
        ctx = self._context(size)
        set_step_context(ctx)
        try:
            for _ in range(2):  # compile kernels and settle the allocator outside the capture
                self.model.compute_logits(self.model(self.ids[:size], self.positions[:size]))
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.model.compute_logits(self.model(self.ids[:size], self.positions[:size]))
            self.pool = graph.pool()
        finally:
            set_step_context(None)
        self.graphs[size] = (graph, logits)

    def page_tables(self, seq_ids: list[int], tables: list[list[int]]) -> np.ndarray:
        """The step's page tables as rows of the host mirror ``[B, max_pages]`` (zero past
        each row's pages). Only rows whose request or pages changed since the last step are
        rewritten, and only those travel to the GPU in ``run``."""
        lo = hi = None
        for b, (sid, pages) in enumerate(zip(seq_ids, tables)):
            held = self._row_of[b]
            if held is not None and held[0] == sid and held[1] == pages:
                continue
            old = len(held[1]) if held is not None else self.host_table.shape[1]
            self.host_table[b, : len(pages)] = pages
            self.host_table[b, len(pages): max(old, len(pages))] = 0
            self._row_of[b] = (sid, list(pages))
            lo, hi = (b if lo is None else lo), b + 1
        self._dirty = None if lo is None else (lo, hi)
        return self.host_table[: len(tables)]

    def run(self, ids: list[int], positions: list[int], slots: np.ndarray, lens: np.ndarray) -> torch.Tensor:
        """slots/lens [L, B] (page tables from ``page_tables`` this step) -> logits [B, V]."""
        batch = len(ids)
        size = self.bucket(batch)
        self.slots[:, batch:size] = -1
        self.lens[:, batch:size] = 1
        self.ids[:batch].copy_(torch.from_numpy(np.asarray(ids, dtype=np.int64)), non_blocking=True)
        self.positions[:batch].copy_(torch.from_numpy(np.asarray(positions, dtype=np.int64)), non_blocking=True)
        self.slots[:, :batch].copy_(torch.from_numpy(slots), non_blocking=True)
        self.lens[:, :batch].copy_(torch.from_numpy(lens), non_blocking=True)
        if self._dirty is not None:
            lo, hi = self._dirty
            self.table[lo:hi].copy_(self._host[lo:hi], non_blocking=True)
        if size not in self.graphs:
            self._capture(size)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:batch]
