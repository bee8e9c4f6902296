"""H2O's accumulated scores, kept per cache slot beside the KV pool.

`h2o_scores_accumulate_*(scores, positions, colsum, page_table, kv_lens, first_new, pos0)`:
one layer's pools `scores [num_pages, page_size, Hkv]` fp32 and `positions [num_pages,
page_size, Hkv]` int32 receive a step's column sums `colsum [B, Hkv, M]` fp32 (M >= every
row's length). For request b and cache index `j < kv_lens[b]` (rows with length 0 are
skipped: CUDA-graph padding), at the slot `page_table[b, j // page_size] * page_size +
j % page_size`:
- `j < first_new[b]` (a token cached before this step): `scores += colsum[b, :, j]`;
- `j >= first_new[b]` (written this step; the slot may hold a stale token's entries):
  `scores = colsum[b, :, j]` and `positions = pos0[b] + j - first_new[b]`.

`_ref` is the plain loop (the oracle), `_torch` its vectorised twin (boolean indexing, so
it syncs on CUDA), `_triton` one program per (request, KV head, block of tokens): no
host sync, CUDA-graph capturable.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._common import cdiv, check_launch, lazy_jit

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


def _check(scores, positions, colsum, page_table) -> tuple[int, int]:
    if scores.dim() != 3 or positions.shape != scores.shape:
        raise ValueError(f"scores and positions must both be [num_pages, page_size, Hkv], got "
                         f"{tuple(scores.shape)} and {tuple(positions.shape)}")
    if scores.dtype != torch.float32 or positions.dtype != torch.int32:
        raise ValueError(f"scores must be float32 and positions int32, got {scores.dtype} and {positions.dtype}")
    B, hkv, _ = colsum.shape
    if hkv != scores.shape[2] or page_table.shape[0] != B:
        raise ValueError(f"colsum [B, Hkv, M] must match Hkv={scores.shape[2]} and page_table's "
                         f"{page_table.shape[0]} rows, got {tuple(colsum.shape)}")
    return scores.shape[1], hkv


def h2o_scores_accumulate_ref(scores, positions, colsum, page_table, kv_lens, first_new, pos0) -> None:
    page_size, hkv = _check(scores, positions, colsum, page_table)
    for b in range(colsum.shape[0]):
        first, p0 = int(first_new[b]), int(pos0[b])
        for j in range(int(kv_lens[b])):
            page, off = int(page_table[b, j // page_size]), j % page_size
            for h in range(hkv):
                c = colsum[b, h, j].float()
                if j >= first:
                    scores[page, off, h] = c
                    positions[page, off, h] = p0 + j - first
                else:
                    scores[page, off, h] += c


def h2o_scores_accumulate_torch(scores, positions, colsum, page_table, kv_lens, first_new, pos0) -> None:
    page_size, hkv = _check(scores, positions, colsum, page_table)
    B, _, M = colsum.shape
    j = torch.arange(M, device=colsum.device)
    valid = j[None, :] < kv_lens.to(colsum.device).long()[:, None]
    rows, cols = valid.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return
    table = page_table.long()
    slots = table[rows, cols // page_size] * page_size + cols % page_size
    first = first_new.to(colsum.device).long()[rows]
    new = cols >= first
    flat_s, flat_p = scores.view(-1, hkv), positions.view(-1, hkv)
    c = colsum[rows, :, cols].float()  # [N, Hkv]
    flat_s[slots] = torch.where(new[:, None], c, flat_s[slots] + c)
    pos = pos0.to(colsum.device).long()[rows] + cols - first
    flat_p[slots[new]] = pos[new].to(torch.int32)[:, None].expand(-1, hkv)


def h2o_scores_accumulate_triton(scores, positions, colsum, page_table, kv_lens, first_new, pos0,
                                 *, block_n: int = 256) -> None:
    page_size, hkv = _check(scores, positions, colsum, page_table)
    if not (scores.is_contiguous() and positions.is_contiguous() and colsum.stride(-1) == 1):
        raise ValueError("scores and positions must be contiguous, colsum contiguous in its last dim")
    check_launch(scores, positions, colsum, page_table, kv_lens, first_new, pos0)
    B, _, M = colsum.shape
    if B == 0 or M == 0:
        return
    _accumulate_kernel[(B, hkv, cdiv(M, block_n))](
        scores, positions, colsum, page_table, kv_lens, first_new, pos0,
        colsum.stride(0), colsum.stride(1), page_table.stride(0), M, hkv,
        PAGE_SIZE=page_size, BLOCK_N=block_n, num_warps=4,
    )


@lazy_jit
def _accumulate_kernel(
    scores_ptr, pos_ptr, colsum_ptr, table_ptr, lens_ptr, first_ptr, pos0_ptr,
    stride_cb, stride_ch, stride_tb, M, HKV,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = tl.load(lens_ptr + b)
    mask = (offs < n) & (offs < M)
    page = tl.load(table_ptr + b * stride_tb + offs // PAGE_SIZE, mask=mask, other=0)
    at = (page.to(tl.int64) * PAGE_SIZE + offs % PAGE_SIZE) * HKV + h
    c = tl.load(colsum_ptr + b * stride_cb + h * stride_ch + offs, mask=mask, other=0.0)
    first = tl.load(first_ptr + b)
    new = offs >= first
    old = tl.load(scores_ptr + at, mask=mask & (offs < first), other=0.0)
    tl.store(scores_ptr + at, old + c, mask=mask)
    pos = tl.load(pos0_ptr + b).to(tl.int64) + offs - first
    tl.store(pos_ptr + at, pos.to(tl.int32), mask=mask & new)
