"""FlashInfer's paged decode inside the engine's decode CUDA graphs.

A FlashInfer decode reads a plan made on the host from the step's lengths. In a CUDA graph
the plan lives in fixed buffers (``use_cuda_graph=True`` wrappers: the page list, its
offsets, the last page's fill, and the split schedule in the wrapper's own int workspace),
so the graph captures kernels that read those buffers, and each replay is preceded by a
new plan written into them (``DecodeGraphs`` calls ``plan`` before every capture and
replay, outside the graph). FlashInfer keeps a graph wrapper's launch shape fixed across
plans for one batch size: the split-KV choice depends on the batch size and heads only.

Layers whose lengths agree share one plan (with no eviction, every layer: one plan a step);
the layout (which plan each layer reads) is what a capture binds, and ``plan`` returns it,
so the graph is captured again when it changes. Host staging buffers are pinned and kept
per plan: their copies run when the stream reaches them, and ``DecodeGraphs`` writes the
next step's only after the previous step's copies ran.

FlashInfer's split schedule (what its ``plan`` writes to the int workspace) is a function of
the page counts alone: both decode kernels' planners read ``indptr`` and nothing of the last
page's fill (0.7.2: ``DecodePlan`` takes ``indptr_h`` only; ``PrefillPlan``, which
tensor-core decode uses, takes ``qo_indptr``/``kv_indptr`` and ignores ``kv_len_arr``). So a
plan whose rows' page counts are those it was last planned for is refreshed, not planned
again: the last page's fill and the page list go straight into the wrapper's buffers (a
decode step crosses a page boundary in a row once every ``page_size`` steps). A FlashInfer
plan costs ~0.17 ms of host time on the H200's host (PyramidKV: a plan per layer;
results/flashinfer_graph_plans_h200.jsonl); in a ragged batch of 64 some row crosses a page
every step, and every plan is made again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

INT_WORKSPACE_BYTES = 512 << 10  # a graph plan's split schedule: a few KB (FlashInfer raises if short)


def page_csr(lens, page_size: int, width: int):
    """FlashInfer's CSR page layout of rows of ``lens`` tokens over a ``[B, width]`` page
    table -> (indptr [B+1], flat [pages]: where each listed page sits in the flattened table,
    last_page_len [B]), numpy int64."""
    lens = np.asarray(lens, dtype=np.int64)
    if lens.size == 0 or lens.min() < 1:
        raise ValueError(f"FlashInfer paged attention needs kv_len >= 1 for every request; got {lens.tolist()}")
    pages = -(-lens // page_size)
    if pages.max() > width:
        raise ValueError(f"kv_len {int(lens.max())} needs {int(pages.max())} pages but the page table holds {width}")
    indptr = np.concatenate([[0], np.cumsum(pages)])
    flat = np.repeat(np.arange(len(lens)) * width - indptr[:-1], pages) + np.arange(indptr[-1])
    return indptr, flat, lens - (pages - 1) * page_size


@dataclass
class _Plan:
    wrapper: object  # flashinfer.BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)
    indptr: torch.Tensor  # [B+1] int32, pinned
    last_page_len: torch.Tensor  # [B] int32, pinned
    flat: torch.Tensor  # [B * W] int64, pinned: where each listed page sits in the page table
    flat_dev: torch.Tensor  # [B * W] int64 on the device
    indices_dev: torch.Tensor  # [B * W] int32: the wrapper's page-list buffer
    last_dev: torch.Tensor  # [B] int32: the wrapper's last-page-fill buffer
    planned: np.ndarray | None = None  # the rows' page counts FlashInfer last planned
    total: int = 0  # their sum


class FlashInferGraphPlans:
    def __init__(self, flashinfer, workspace: torch.Tensor, tensor_cores: bool) -> None:
        self.flashinfer = flashinfer
        self.workspace = workspace  # float scratch, shared with the eager wrappers (one stream)
        self.tensor_cores = tensor_cores
        self._plans: dict[object, list[_Plan]] = {}  # graph id -> one plan per layout group
        self._layouts: dict[object, tuple[int, ...]] = {}

    def plan(self, graph, lens: np.ndarray, table: torch.Tensor, page_size: int, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, ...]:
        """Plan graph ``graph``'s decode for lengths ``lens`` ``[L, B]`` (host) over ``table``
        ``[B, W]`` (device, int32) -> the layout: per layer, the plan it reads."""
        groups: dict[bytes, int] = {}
        layout = tuple(groups.setdefault(np.ascontiguousarray(row).tobytes(), len(groups)) for row in lens)
        first = {}
        for layer, g in enumerate(layout):
            first.setdefault(g, layer)
        plans = self._plans.setdefault(graph, [])
        batch, width = table.shape
        for g, layer in first.items():
            if g == len(plans):
                plans.append(self._new_plan(batch, width, table.device))
            self._plan_one(plans[g], lens[layer], table, page_size, num_qo_heads, num_kv_heads, head_dim, dtype)
        self._layouts[graph] = layout
        return layout

    def layouts(self) -> dict[object, tuple[int, ...]]:
        """Each graph's layout as last planned."""
        return dict(self._layouts)

    def wrapper(self, graph, layer: int):
        """The wrapper layer ``layer`` of graph ``graph`` reads (planned by ``plan``)."""
        layout = self._layouts.get(graph)
        if layout is None:
            raise RuntimeError(f"FlashInfer graph plans: graph {graph!r} was not planned before its capture")
        return self._plans[graph][layout[layer]].wrapper

    def _new_plan(self, batch: int, width: int, device) -> _Plan:
        def buf(n, dtype, pinned):
            return torch.zeros(n, dtype=dtype, device="cpu", pin_memory=True) if pinned else \
                torch.zeros(n, dtype=dtype, device=device)

        indices, last = buf(batch * width, torch.int32, False), buf(batch, torch.int32, False)
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=buf(batch + 1, torch.int32, False), paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last, backend="fa2")
        wrapper.reset_workspace_buffer(self.workspace, buf(INT_WORKSPACE_BYTES, torch.uint8, False))
        return _Plan(wrapper, buf(batch + 1, torch.int32, True), buf(batch, torch.int32, True),
                     buf(batch * width, torch.int64, True), buf(batch * width, torch.int64, False), indices, last)

    @staticmethod
    def _plan_one(p: _Plan, lens: np.ndarray, table: torch.Tensor, page_size: int, num_qo_heads: int,
                  num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        lens = np.asarray(lens, dtype=np.int64)
        pages = -(-lens // page_size)
        if p.planned is not None and np.array_equal(p.planned, pages):  # same schedule: refresh
            p.last_page_len.numpy()[:] = lens - (pages - 1) * page_size
            p.last_dev.copy_(p.last_page_len, non_blocking=True)
            torch.index_select(table.reshape(-1), 0, p.flat_dev[:p.total], out=p.indices_dev[:p.total])
            return
        indptr, flat, last_page_len = page_csr(lens, page_size, table.shape[1])
        total = len(flat)
        p.last_page_len.numpy()[:] = last_page_len
        p.flat.numpy()[:total] = flat
        p.indptr.numpy()[:] = indptr
        p.flat_dev[:total].copy_(p.flat[:total], non_blocking=True)
        indices = table.reshape(-1).index_select(0, p.flat_dev[:total]).to(torch.int32)
        p.wrapper.plan(p.indptr, indices, p.last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                       pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype, non_blocking=True)
        p.planned, p.total = pages, total
