"""Decode CUDA graphs over batch-size buckets (every size up to `EXACT_BUCKETS`, 8, then every 16).

A graph is captured lazily per bucket for pure-decode steps whose method asks for no
per-layer hooks in the forward, or whose hooks are graph-capturable (tensor-only; the
capture context has ``is_decode`` True and ``seqs = [None] * B``; the runner calls the
method's ``begin_step_graph`` before every replay and capture). A method whose hooks read
per-request state gives a ``graph_key`` instead: its graph is captured for the step's
requests (in the context) and replayed while the key holds (one per bucket). Inputs live in static
buffers: token ids, positions, per-layer slot mappings and lengths, and a page table as
wide as the method's longest row needs (``table_pages``), so a replay never depends on
the batch's lengths.
Padding rows write nowhere (slot -1) and read one token of page 0. A provider whose kernels
read plans made on the host (FlashInfer's) makes them in ``plan_graph_step`` before every
capture and replay, outside the graph; the graph is captured again when what it bound changes.
The engine captures on CUDA only; built on the CPU, a capture is a ``Rerun`` (the tests drive
the graph path there, with the Triton kernels interpreted).
"""

from __future__ import annotations

import numpy as np
import torch

from sparseengine.engine.page_table import PageTable
from sparseengine.engine.step_context import LayerView, StepContext, set_step_context


# Every batch size up to this is a bucket of its own; above it 16, 32, ... (and the largest).
# Padding rows cost the CUDA linears (kernels/cuda_linear) their x loads, norms and stores:
# at the Llama-3.1-8B shape 8 rows against 6 took ~1.5 us a layer more (cuda_linear_h200.jsonl),
# and a 128K batch of 6 (the benchmark's largest) otherwise replays the graph of 8.
EXACT_BUCKETS = 8


def buckets(max_batch: int, exact: int = EXACT_BUCKETS) -> list[int]:
    sizes = list(range(1, min(exact, max_batch) + 1)) + [b for b in (2, 4, 8) if exact < b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def table_pages(method, max_model_len: int, page_size: int) -> int:
    """The graph's page-table width: pages of the longest row the method ever holds,
    probed at short, middle and full-length prompts (an eviction method's rows stop at its
    total, so its graph neither carries nor splits over a max_model_len-wide table). A row
    longer than this runs eager (the runner checks), never wrong."""
    rows = max(min(max_model_len, method.max_cache_tokens(p, max_model_len - p))
               for p in (1, max(1, max_model_len // 2), max_model_len))
    return -(-(rows + 1) // page_size)


def _zeros(shape, dtype, device, pinned: bool) -> torch.Tensor:
    t = torch.zeros(shape, dtype=dtype, device=device)
    return t.pin_memory() if pinned else t


def _input_buffers(top: int, layers: int, device, pinned: bool):
    """One byte buffer and its views: ids [top], positions [top], slots [layers, top] (int64),
    lens [layers, top] (int32)."""
    n64, n32 = 2 * top + layers * top, layers * top
    buf = _zeros(8 * n64 + 4 * n32, torch.uint8, device, pinned)
    longs, ints = buf[: 8 * n64].view(torch.int64), buf[8 * n64:].view(torch.int32)
    return buf, (longs[:top], longs[top:2 * top], longs[2 * top:].view(layers, top), ints.view(layers, top))


class Rerun:
    """A captured decode graph where CUDA graphs do not exist (the CPU): each replay runs the
    capture's forward again, over the same static input buffers, in the same step context
    (padding rows, device lengths, placeholder host lengths), so the graph path's host side
    and its graph-shaped inputs run on any device. Unlike a CUDA graph it runs the Python of
    the method's hooks again at every replay, so it does not catch state a capture baked in."""

    def __init__(self, forward, ctx: StepContext, logits: torch.Tensor) -> None:
        self.forward, self.ctx, self.logits = forward, ctx, logits

    def replay(self) -> None:
        set_step_context(self.ctx)
        try:
            out = self.forward()
        finally:
            set_step_context(None)
        self.logits.resize_(out.shape).copy_(out)  # the tensor ``run`` returns, as a graph's output


class DecodeGraphs:
    def __init__(self, model, kv_cache, provider, method, device, max_batch: int, max_pages: int,
                 exact_buckets: int = EXACT_BUCKETS) -> None:
        self.model, self.kv_cache, self.provider, self.method = model, kv_cache, provider, method
        self.device = device
        self.sizes = buckets(max_batch, exact_buckets)
        top, layers = self.sizes[-1], model.config.num_layers
        pinned = torch.device(device).type == "cuda"
        # The step's inputs (ids, positions, slots, lens) live in one byte buffer on each
        # side, the graph reading views of the device one: a step fills the pinned host
        # buffer and sends it in one copy.
        self._in_host, (h_ids, h_pos, h_slots, h_lens) = _input_buffers(top, layers, "cpu", pinned)
        self._in_dev, (self.ids, self.positions, self.slots, self.lens) = _input_buffers(top, layers, device, False)
        self._in = tuple(t.numpy() for t in (h_ids, h_pos, h_slots, h_lens))
        self._in[2][:] = -1  # padding rows write nowhere and read one token
        self._in[3][:] = 1
        self._in_dev.copy_(self._in_host)
        self.table = torch.zeros((top, max_pages), dtype=torch.int32, device=device)
        self.cu = torch.arange(top + 1, dtype=torch.int32, device=device)
        # per bucket: (the provider's plan layout it was captured with, graph, logits)
        self.graphs: dict[int, tuple[object, torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # graphs of a method's ``graph_key``: per bucket the last key's ((key, layout), graph, logits)
        self.keyed: dict[int, tuple[object, torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.captured: list[tuple[int, object]] = []  # (bucket, graph id) of every capture, in order
        # host mirror of ``table`` (pinned: its rows go up without a staging copy); per row,
        # what it holds: (request id, the request's table, its length), so a step rewrites
        # and re-sends only what changed
        self._host = _zeros((top, max_pages), torch.int32, "cpu", pinned)
        self.host_table = self._host.numpy()  # the same memory, written row by row
        self._row_of: list[tuple[int, PageTable, int] | None] = [None] * top
        self._dirty: tuple[int, int] | None = None
        # The pinned host buffers above go to the device with copies that run when the
        # stream reaches them, which may be after the host moved on (asynchronous
        # scheduling reads a step's tokens only during the next step): a step writes them
        # only once the previous step's copies have run.
        self._staged = torch.cuda.Event() if pinned else None

    def _host_writable(self) -> None:
        if self._staged is not None:
            self._staged.synchronize()

    def fits(self, seqs) -> bool:
        """Every request's page table fits the graph's table width."""
        return max(len(s.page_table) for s in seqs) <= self.table.shape[1]

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.sizes if b >= batch), None)

    def _context(self, size: int, seqs=None, graph=None) -> StepContext:
        layers = self.model.config.num_layers
        views = [LayerView(self.slots[l, :size], self.lens[l, :size], (1,) * size, self.table[:size])
                 for l in range(layers)]
        rows = [None] * size if seqs is None else list(seqs) + [None] * (size - len(seqs))
        return StepContext(seqs=rows, q_lens=(1,) * size, cu_q_lens=self.cu[: size + 1], is_decode=True,
                           views=views, kv_cache=self.kv_cache, provider=self.provider, method=self.method,
                           positions=self.positions[:size], graph=graph)

    def _capture(self, size: int, seqs=None, graph_id=None) -> "tuple[torch.cuda.CUDAGraph | Rerun, torch.Tensor]":
        """Capture a graph of the bucket (``seqs``: the requests a keyed graph is for, in the
        context; else every row None). The warm-up runs execute for real, so they see only
        padding inputs (no cache or method state is written: a method's in-graph update,
        such as H2O's score sums, must count once); the step's staged inputs return after.
        Where there are no CUDA graphs (the CPU), a ``Rerun`` stands in: nothing is run here."""
        if self._in_dev.device.type != "cuda":
            ctx = self._context(size, seqs, graph_id)
            forward = lambda: self.model.compute_logits(self.model(self.ids[:size], self.positions[:size]))
            logits = torch.empty(0)
            return Rerun(forward, ctx, logits), logits
        staged = self._in_host.clone()
        self._in[2][:] = -1
        self._in[3][:] = 1
        self._in_dev.copy_(self._in_host)
        ctx = self._context(size, seqs, graph_id)
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
            self._in_host.copy_(staged)
            self._in_dev.copy_(self._in_host)
        return graph, logits

    def page_tables(self, seq_ids: list[int], tables: list[PageTable]) -> np.ndarray:
        """The step's page tables as rows of the host mirror ``[B, max_pages]`` (zero past
        each row's pages). A row is rewritten from the first page its table marks changed
        (all of it for a new request or table), and only rewritten rows travel to the GPU
        in ``run``."""
        self._host_writable()
        lo = hi = None
        for b, (sid, pages) in enumerate(zip(seq_ids, tables)):
            held = self._row_of[b]
            start = pages.take_changed_from()
            if held is not None and held[0] == sid and held[1] is pages:
                if start is None:
                    continue
            else:  # a new request in the row, or a new table: all of it
                start = 0
                self._forget(sid)  # any other row it held is stale now: its changes were taken here
            old = held[2] if held is not None else self.host_table.shape[1]
            self.host_table[b, start: len(pages)] = pages[start:]
            self.host_table[b, len(pages): max(old, len(pages))] = 0
            self._row_of[b] = (sid, pages, len(pages))
            lo, hi = (b if lo is None else lo), b + 1
        self._dirty = None if lo is None else (lo, hi)
        return self.host_table[: len(tables)]

    def _forget(self, sid: int) -> None:
        for r, held in enumerate(self._row_of):
            if held is not None and held[0] == sid:
                self._row_of[r] = None

    def stage_inputs(self, ids: list[int], positions: list[int], slots: np.ndarray, lens: np.ndarray,
                     size: int) -> None:
        """Rows ``[0, B)`` from the step, rows ``[B, size)`` padding (slot -1, length 1), all
        sent to the graph's input buffers in one copy."""
        self._host_writable()
        batch = len(ids)
        h_ids, h_pos, h_slots, h_lens = self._in
        h_ids[:batch], h_pos[:batch] = ids, positions
        h_slots[:, :batch], h_lens[:, :batch] = slots, lens
        h_slots[:, batch:size], h_lens[:, batch:size] = -1, 1
        self._in_dev.copy_(self._in_host, non_blocking=True)

    def run(self, ids: list[int], positions: list[int], slots: np.ndarray, lens: np.ndarray, seqs=None,
            key=None, feed=None) -> torch.Tensor:
        """slots/lens [L, B] (page tables from ``page_tables`` this step) -> logits [B, V].
        ``key`` (the method's ``graph_key`` of ``seqs``): replay the bucket's graph of that
        key, captured for these requests now if the key changed (the old one is dropped).
        ``feed`` (``inflight.Feed``): rows whose token id is on the device, written over
        the staged ids just before the replay."""
        batch = len(ids)
        size = self.bucket(batch)
        self.stage_inputs(ids, positions, slots, lens, size)
        if self._dirty is not None:
            lo, hi = self._dirty
            self.table[lo:hi].copy_(self._host[lo:hi], non_blocking=True)
        graph_id = (size, key is not None)
        layout = self.provider.plan_graph_step(graph_id, self._in[3][:, :size], self.table[:size],
                                               self.kv_cache.layer(0)[0], self.model.config.num_heads)
        if self._staged is not None:
            self._staged.record()  # the host buffers (ours, a provider's plans) are free again once these copies ran
        store, want = (self.graphs, layout) if key is None else (self.keyed, (key, layout))
        held = store.get(size)
        if held is None or held[0] != want:
            store.pop(size, None)  # its memory returns to the pool first
            held = store[size] = (want, *self._capture(size, None if key is None else seqs, graph_id))
            self.captured.append((size, graph_id))
        _, graph, logits = held
        if feed is not None:  # after any capture: its warm-up runs restage the host's ids
            feed.apply(self.ids)
        graph.replay()
        return logits[:batch]
