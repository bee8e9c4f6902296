"""The balanced split plan: the split-K decode's chunks for a batch of uneven rows.

Where `split_plan` cuts each row (request x KV head) by its own length into `num_splits`
chunks, a row far longer than its neighbours (a ragged batch: one 128K request among
2K ones) runs in `num_splits` long programs while the short rows' finish early. The
balanced plan takes one chunk length for the whole batch instead, so the long row takes
more programs, not longer ones; rows of like lengths keep the per-row plan's slots. The
split kernel computes the plan on the device at every launch (CUDA-graph replays follow
the lengths), each program for its own chunk (`balanced_chunk`, over a flat grid of
`rows * (num_splits + 1)` programs); `balanced_chunks` is its torch twin and definition.
The merge finds each row's chunks in a `[rows, 2]` int32 plan (first chunk, chunks).

H200, per launch (bench_gpu --splits-ragged, results/decode_ragged_h200.jsonl, commit
cbc0c33), balanced / per-row plan: 16 requests, one of 128K tokens and 15 of 2304, 191 /
315 us; 100 requests, one of 128K and 99 of 1024, 275 / 2167 us; uniform rows 0-12% more
(16 x 2304 56.0 / 50.0 us, 183 x 2304 394.8 / 395.2).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _common
from ._common import cdiv, shared_helper

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl

# Every program reads every row's length, in blocks of at most BALANCED_ROW_BLOCK rows;
# beyond MAX_BALANCED_ROWS rows the per-row plan runs instead.
BALANCED_ROW_BLOCK = 2048
MAX_BALANCED_ROWS = 8192
# Rows of like lengths keep the per-row plan's num_splits slots (no prefix sum over the
# rows) unless the longest needs more than this many times num_splits of the batch's
# chunks. At 1 (bf62058) a batch of rows a few decode steps apart took the prefix-sum path
# and SnapKV's lane at batch 183 fell from 8649 to 7731 tok/s.
BALANCED_SLACK = 2


def use_balanced(balanced: bool | None, chunk: int, auto: bool, rows: int) -> bool:
    """Whether a launch takes the balanced plan: asked, or (None) the auto plan's per-row
    chunks (`split_plan` chunk 0), for up to `MAX_BALANCED_ROWS` rows."""
    if balanced is None:
        return auto and not chunk and rows <= MAX_BALANCED_ROWS
    if balanced and rows > MAX_BALANCED_ROWS:
        raise ValueError(f"the balanced plan takes at most {MAX_BALANCED_ROWS} rows (B * Hkv), got {rows}")
    return bool(balanced)


# Warps of a balanced launch's programs: 2 from 4 to 6 rows an SM (rows that fill the GPU on
# their own in one or two chunks each, few programs an SM), else 4 as every other split launch.
# H200 (bench_gpu --splits-tune, commit 3fe5cb1, results/decode_splits_tune_h200.jsonl), per
# launch, 4 warps against 2: 73 x 8448 tokens (584 rows) 672.7 against 608.5 us; elsewhere
# within 4% either way (16 x 2304 55.3 / 54.6, 183 x 2304 404.0 / 414.5). End to end (commit
# 7843297, 2 warps below 8 rows an SM): SnapKV total 8192 at batch 73 (584 rows) 2847.5 tok/s
# against 2635.5 at 69c63ec, but PyramidKV at batch 128 (1024 rows) 7134.7 against 8033.8 and
# SnapKV total 2048 at 128 7442.2 against 7735.0: hence the band.
FEW_WARPS_ROWS_PER_SM = (4, 6)


def split_warps(balanced: bool, rows: int, device) -> int:
    """The split kernel's warps a program: 2 for a balanced launch of `FEW_WARPS_ROWS_PER_SM`
    rows an SM (more programs in flight where each SM has few), else 4."""
    lo, hi = (n * _common.num_sms(device) for n in FEW_WARPS_ROWS_PER_SM)
    return 2 if balanced and lo <= rows < hi else 4


def plan_buffer(plan_out, rows: int, device) -> torch.Tensor:
    """The launch's plan buffer: `plan_out` (checked) or a new one."""
    if plan_out is None:
        return torch.empty((rows, 2), dtype=torch.int32, device=device)
    if plan_out.shape != (rows, 2) or plan_out.dtype != torch.int32 or not plan_out.is_contiguous():
        raise ValueError(f"plan_out must be a contiguous int32 [{rows}, 2] tensor, got "
                         f"{plan_out.dtype} {tuple(plan_out.shape)}")
    return plan_out


def no_plan(plan_out, placeholder: torch.Tensor) -> torch.Tensor:
    """A launch without the balanced plan: `placeholder` stands in (unread); a `plan_out` is an error."""
    if plan_out is not None:
        raise ValueError("plan_out is written by the balanced plan only (balanced=False or a fixed-chunk plan)")
    return placeholder


def balanced_chunks(n_items: torch.Tensor, num_splits: int, block_n: int, min_chunk: int = 0,
                    slack: int = BALANCED_SLACK):
    """The balanced plan (the torch twin of `balanced_chunk`): R rows of `n_items [R]` items
    in num_splits chunk slots a row (the kernel launches R more programs: rounding can add
    one chunk a row). One chunk
    length for the batch, C = ceil(total / (R * num_splits)) rounded up to whole `block_n`
    blocks. Rows of like lengths (ceil(max n / C) <= slack * num_splits) keep the per-row
    plan's slots: row r's chunks start at r * num_splits, at most num_splits of them. Else
    (a row far longer than the others) the chunks are numbered row after row, as many as
    a row needs: the long row takes more chunks, not longer ones. Either way a row of n
    items takes k = ceil(n / C) chunks (within those limits; at most n // min_chunk where
    min_chunk > 0; at least 1) of ceil(n / k) items each, whole blocks. Returns per row
    (first chunk, chunks, chunk length) as int64 [R] tensors."""
    n = n_items.to(torch.int64)
    c = max(1, cdiv(cdiv(int(n.sum()), n.numel() * num_splits), block_n)) * block_n
    like = cdiv(int(n.max()), c) <= slack * num_splits
    k = ((n + c - 1) // c).clamp(min=1)
    if like:
        k = k.clamp(max=num_splits)
    if min_chunk > 0:
        k = torch.minimum(k, (n // min_chunk).clamp(min=1))
    chunk = (((n + k - 1) // k + block_n - 1) // block_n).clamp(min=1) * block_n
    k = ((n + chunk - 1) // chunk).clamp(min=1)
    if like:
        return torch.arange(n.numel()) * num_splits, k, chunk
    return torch.cumsum(k, 0) - k, k, chunk


@shared_helper
def balanced_row_items(kv_lens_ptr, num_sel_ptr, stride_ns_b, stride_ns_h, r, ok, HKV, PAGE_SIZE: tl.constexpr,
                       MODE: tl.constexpr):
    """Items of rows `r` (request x KV head; a block or one) where `ok`: the request's
    tokens, the row's selected tokens, or its selected pages' tokens."""
    if MODE == 0:
        n = tl.load(kv_lens_ptr + r // HKV, mask=ok, other=0)
    else:
        n = tl.load(num_sel_ptr + (r // HKV) * stride_ns_b + (r % HKV) * stride_ns_h, mask=ok, other=0)
        if MODE == 2:
            n = n * PAGE_SIZE
    return n.to(tl.int32)


@shared_helper
def balanced_row_chunks(n, c, min_chunk, cap, BLOCK_N: tl.constexpr):
    """(chunks, chunk length) of rows of n items under the batch's chunk c, at most `cap`
    chunks a row (`balanced_chunks`)."""
    k = tl.minimum(tl.maximum(tl.cdiv(n, c), 1), cap)
    if min_chunk > 0:
        k = tl.minimum(k, tl.maximum(n // min_chunk, 1))
    chunk = tl.maximum(tl.cdiv(tl.cdiv(n, k), BLOCK_N), 1) * BLOCK_N
    return tl.maximum(tl.cdiv(n, chunk), 1), chunk


@shared_helper
def balanced_chunk(kv_lens_ptr, num_sel_ptr, stride_ns_b, stride_ns_h, rows, num_splits, min_chunk, HKV, item,
                   PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, BLOCK_R: tl.constexpr,
                   SLACK: tl.constexpr):
    """Chunk `item` of the balanced plan (`balanced_chunks`, its definition),
    computed alike by every program from the rows' lengths, read in blocks of BLOCK_R.
    Returns (row, index in the row (-1: no such chunk: the program idles), the row's first
    chunk, its chunks, its chunk length, its items). Only scalars leave: the row arrays
    are dead before the attention's loop."""
    total = tl.zeros([], tl.int64)
    n_max = tl.zeros([], tl.int32)
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        n = balanced_row_items(kv_lens_ptr, num_sel_ptr, stride_ns_b, stride_ns_h, r, r < rows, HKV, PAGE_SIZE,
                               MODE)
        total += tl.sum(n.to(tl.int64), 0)
        n_max = tl.maximum(n_max, tl.max(n, 0))
    c = tl.maximum(tl.cdiv(tl.cdiv(total, rows * num_splits), BLOCK_N), 1).to(tl.int32) * BLOCK_N
    row = item // num_splits  # like lengths: row r's chunks from r * num_splits, at most num_splits
    first = row * num_splits
    cap = num_splits
    if tl.cdiv(n_max, c) > SLACK * num_splits:  # a row far longer: the chunks numbered row after row
        cap = tl.full([], 1 << 30, tl.int32)
        row = tl.zeros([], tl.int32)
        first = tl.zeros([], tl.int32)
        carry = tl.zeros([], tl.int32)  # chunks of the blocks before
        for r0 in range(0, rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            ok = r < rows
            n = balanced_row_items(kv_lens_ptr, num_sel_ptr, stride_ns_b, stride_ns_h, r, ok, HKV, PAGE_SIZE,
                                   MODE)
            k = tl.where(ok, balanced_row_chunks(n, c, min_chunk, cap, BLOCK_N)[0], 0)
            before = carry + tl.cumsum(k, 0) <= item  # rows wholly before the item's
            row += tl.sum(before.to(tl.int32), 0)
            first += tl.sum(tl.where(before, k, 0), 0)
            carry += tl.sum(k, 0)
    n_row = balanced_row_items(kv_lens_ptr, num_sel_ptr, stride_ns_b, stride_ns_h, row, row < rows, HKV,
                               PAGE_SIZE, MODE)
    k_row, chunk = balanced_row_chunks(n_row, c, min_chunk, cap, BLOCK_N)
    split = item - first
    return row, tl.where((row < rows) & (split < k_row), split, -1), first, k_row, chunk, n_row
