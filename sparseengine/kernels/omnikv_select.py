"""OmniKV's token pick on the GPU: sink + top-`budget` + recent, no sort.

`omnikv_select_triton(scores, kv_lens, sink_tokens, budget, recent_tokens)` has the
contract of `sparseengine.methods.omnikv.pick_tokens` (the torch path), with the max over
heads folded in: `scores [B, H, L]` (a filter layer's per-KV-head max logits) or `[B, L]`,
any float dtype; entries at or past `kv_lens[b] - recent` are never read -> `(indices [B,
K]` int64, `counts [B]` int32), `K = sink + budget + recent`. A request of `n > K` tokens
gets `[0, sink)`, the top `budget` of its middle tokens `[sink, n - recent)` ascending,
then `[n - recent, n)`; a shorter one gets `0 .. K-1` with count n. Ties go to the earlier
token, which `torch.topk` does not promise.

How: a radix search for the budget-th largest middle key t, a byte a pass, spread over
every (request, block of tokens) program, so its cost does not depend on how the scores
are distributed. A score maps to an int32 key of the same order (negative floats flip
their low 31 bits; -0.0 counts as +0.0), searched as uint32 (the sign bit flipped).
1. `_hist_kernel`, pass 0: the max over heads, the keys written, and each block's
   histogram of the keys' top byte added into the request's (atomics, 256 bins).
2. Passes 1-3: each program settles the bytes so far from the histograms before (a
   reverse cumulative sum: the largest byte with at least the still-needed keys at or
   above it), then histograms the next byte of its keys that match them.
3. `_count_kernel`: after four passes t is settled, with the number of keys equal to t
   still to take (ties); each block counts its keys > t and == t.
4. `_emit_kernel`: each block sums the counts of the blocks before it, so it knows its
   first output slot and how many earlier ties were taken, and writes its keys > t and its
   share of the earliest ties at their ranks (an exclusive `tl.cumsum`): ascending output;
   block 0 also writes the request's count and its sink and recent slots.
Six kernel launches after a memset that zeroes the histograms; no host sync, fixed
shapes: CUDA-graph capturable. At the 128K benchmark's shape (6 x 8 x 133120, 1472 chosen)
44 us a pick against 128 us for the torch path (results/omnikv_select_h200.jsonl).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._common import cdiv, check_launch, check_lens, check_scores, int_arg, lazy_jit, next_pow2

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl

PASSES = 4  # bytes of a 32-bit key
# The launch when the caller names none (read at each call; --kernel-const sets them for
# A/Bs): tokens a program, warps a program. H200, the 128K shape, per pick (session 11,
# results/omnikv_select_h200.jsonl): blocks of 1024 44.0 us, of 2048 41.7. OmniKV b=6, its
# three picks' launches in the graph step (session 44, call s44-3,
# results/omnikv_filter_launch_s44_h200.jsonl): 43.7 us a pick in blocks of 2048 against
# 50.6 in blocks of 1024 (4096 at 8 warps: 59.9), graph step 8.438 / 8.450 ms against
# 8.457 / 8.455.
BLOCK = 2048
WARPS = 4
# Whether OmniKV asks its fused pick for the chosen tokens' pool rows (read at each step; an
# A/B switch: False, its later layers look each token up in the page table)
EMIT_POOL_ROWS = True


def omnikv_select_triton(scores, kv_lens, sink_tokens, budget, recent_tokens, *, block: int | None = None,
                         num_warps: int | None = None, page_table=None, page_size: int = 0):
    """`block`: tokens per program (a power of two >= 16); `num_warps`: per program
    (None: `BLOCK`, `WARPS`).
    `page_table [B, P]` with `page_size`: also the chosen tokens' pool rows, a third output
    `[B, K]` int32 (`page_table[b, t // page_size] * page_size + t % page_size`, -1 past a
    request's count), written beside the tokens (the rows variant of the sparse decode
    reads them with no page-table load)."""
    check_scores(scores, (2, 3), "[B, L] or [B, H, L]")
    if scores.dim() == 2:
        scores = scores[:, None, :]
    B, H, L = scores.shape
    check_lens(kv_lens, B)
    sink = int_arg("sink_tokens", sink_tokens, 0)
    budget = int_arg("budget", budget, 0)
    recent = int_arg("recent_tokens", recent_tokens, 0)
    block = BLOCK if block is None else block
    num_warps = WARPS if num_warps is None else num_warps
    if int_arg("block", block, 16) & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    device = check_launch(scores, kv_lens)
    total = sink + budget + recent
    with_rows = page_table is not None
    if with_rows:
        if page_table.dim() != 2 or page_table.shape[0] != B or int_arg("page_size", page_size, 1) < 1:
            raise ValueError(f"page_table must be [B={B}, P] with page_size >= 1, got "
                             f"{tuple(page_table.shape)} and {page_size}")
        rows = torch.empty((B, total), dtype=torch.int32, device=device)  # every slot written
    if L <= total or B == 0:  # no request can hold more than the total
        everything = torch.arange(total, device=device).expand(B, total)
        counts = kv_lens.clamp(max=total).to(torch.int32)
        if not with_rows:
            return everything, counts
        within = everything < counts[:, None]
        tok = torch.where(within, everything, 0)
        pages = page_table.long().gather(1, tok // page_size)
        return everything, counts, torch.where(within, pages * page_size + tok % page_size, -1).int()
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    n_blocks = cdiv(L, block)
    keys = torch.empty((B, L), dtype=torch.int32, device=device)
    hist = torch.zeros((B, PASSES, 256), dtype=torch.int32, device=device)
    block_counts = torch.empty((B, n_blocks, 2), dtype=torch.int32, device=device)
    indices = torch.empty((B, total), dtype=torch.int64, device=device)
    counts = torch.empty((B,), dtype=torch.int32, device=device)  # min(n, total), written by the emit
    grid = (B, n_blocks)
    common = dict(SINK=sink, BUDGET=budget, RECENT=recent, BLOCK=block, num_warps=num_warps)
    for p in range(PASSES):
        _hist_kernel[grid](scores, kv_lens, keys, hist, scores.stride(0), scores.stride(1), L, H=H, PASS=p, **common)
    _count_kernel[grid](keys, hist, kv_lens, block_counts, L, n_blocks, **common)
    _emit_kernel[grid](keys, hist, kv_lens, block_counts, indices, counts, L, n_blocks,
                       page_table if with_rows else kv_lens, rows if with_rows else indices,
                       page_table.stride(0) if with_rows else 0, PAGE_SIZE=page_size if with_rows else 0,
                       BLOCK_N=next_pow2(n_blocks), BLOCK_K=next_pow2(total), **common)
    return (indices, counts, rows) if with_rows else (indices, counts)


def _ordered_keys(s):
    """int32 keys of fp32 `s`, ordered as the floats; -0.0 is +0.0."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _settle(hist_row, m, PASSES_DONE: tl.constexpr):
    """(prefix, need): the top 8 * PASSES_DONE bits of the m-th largest key (as uint32, the
    rest zero), from the histograms of the passes done, and how many of the keys matching
    them the m largest still need (after four passes: the keys equal to t to take)."""
    prefix = tl.zeros([], tl.uint32)
    need = m + tl.zeros([], tl.int32)
    digits = tl.arange(0, 256)
    for p in tl.static_range(PASSES_DONE):
        h = tl.load(hist_row + p * 256 + digits)
        at_least = tl.cumsum(h, 0, reverse=True)  # matching keys with this byte or a larger one
        d = tl.max(tl.where(at_least >= need, digits, 0), 0)  # byte 0 always qualifies
        need -= tl.sum(tl.where(digits > d, h, 0), 0)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * p))
    return prefix, need


def _block(kv_lens_ptr, L, SINK: tl.constexpr, RECENT: tl.constexpr, BLOCK: tl.constexpr):
    """This program's (request, token positions, middle mask, the request's length)."""
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(kv_lens_ptr + b).to(tl.int32)
    return b, offs, (offs >= SINK) & (offs < n - RECENT) & (offs < L), n


def _threshold(hist_ptr, b, BUDGET: tl.constexpr):
    """(t, ties): the request's budget-th largest key, settled by the four passes, and how
    many keys equal to it the pick takes."""
    prefix, ties = _settle(hist_ptr + b * (4 * 256), BUDGET, 4)
    return prefix.to(tl.int32, bitcast=True) ^ -2147483648, ties


@lazy_jit
def _hist_kernel(scores_ptr, kv_lens_ptr, keys_ptr, hist_ptr, stride_b, stride_h, L,
                 H: tl.constexpr, PASS: tl.constexpr, SINK: tl.constexpr, BUDGET: tl.constexpr,
                 RECENT: tl.constexpr, BLOCK: tl.constexpr):
    b, offs, middle, n = _block(kv_lens_ptr, L, SINK, RECENT, BLOCK)
    if n > SINK + BUDGET + RECENT:  # else the request takes every token: no search
        hist_row = hist_ptr + b * (4 * 256)
        keys = keys_ptr + b.to(tl.int64) * L
        if PASS == 0:  # the keys: the max over heads of the middle tokens' scores
            row = scores_ptr + b.to(tl.int64) * stride_b
            s = tl.load(row + offs, mask=middle, other=float("-inf")).to(tl.float32)
            for h in range(1, H):
                s = tl.maximum(s, tl.load(row + h * stride_h + offs, mask=middle, other=float("-inf")).to(tl.float32))
            key = tl.where(middle, _ordered_keys(s), -2147483648)
            tl.store(keys + offs, key, mask=offs < L)
            u = (key ^ -2147483648).to(tl.uint32, bitcast=True)
            match = middle
        else:
            key = tl.load(keys + offs, mask=middle, other=-2147483648)
            u = (key ^ -2147483648).to(tl.uint32, bitcast=True)
            prefix, _ = _settle(hist_row, BUDGET, PASS)
            match = middle & ((u >> (32 - 8 * PASS)) == (prefix >> (32 - 8 * PASS)))
        h = tl.histogram(((u >> (24 - 8 * PASS)) & 255).to(tl.int32), 256, mask=match)
        tl.atomic_add(hist_row + PASS * 256 + tl.arange(0, 256), h, mask=h > 0, sem="relaxed")


@lazy_jit
def _count_kernel(keys_ptr, hist_ptr, kv_lens_ptr, counts_ptr, L, n_blocks,
                  SINK: tl.constexpr, BUDGET: tl.constexpr, RECENT: tl.constexpr, BLOCK: tl.constexpr):
    b, offs, middle, n = _block(kv_lens_ptr, L, SINK, RECENT, BLOCK)
    if n > SINK + BUDGET + RECENT:
        key = tl.load(keys_ptr + b.to(tl.int64) * L + offs, mask=middle, other=-2147483648)
        t, _ = _threshold(hist_ptr, b, BUDGET)
        out = counts_ptr + (b * n_blocks + tl.program_id(1)) * 2
        tl.store(out, tl.sum((middle & (key > t)).to(tl.int32), 0))
        tl.store(out + 1, tl.sum((middle & (key == t)).to(tl.int32), 0))


@lazy_jit
def _emit_kernel(keys_ptr, hist_ptr, kv_lens_ptr, counts_ptr, out_ptr, n_out_ptr, L, n_blocks, pt_ptr, rows_ptr,
                 stride_pt,
                 PAGE_SIZE: tl.constexpr, SINK: tl.constexpr, BUDGET: tl.constexpr, RECENT: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    TOTAL: tl.constexpr = SINK + BUDGET + RECENT
    b, offs, middle, n = _block(kv_lens_ptr, L, SINK, RECENT, BLOCK)
    blk = tl.program_id(1)
    out = out_ptr + b.to(tl.int64) * TOTAL
    everything = n <= TOTAL
    if blk == 0:  # the count; sink and recent slots (every slot when the request is within the total)
        tl.store(n_out_ptr + b, tl.minimum(n, TOTAL))
        j = tl.arange(0, BLOCK_K)
        fixed = everything | (j < SINK) | (j >= SINK + BUDGET)
        token = tl.where(everything | (j < SINK), j, n - TOTAL + j)
        tl.store(out + j, token.to(tl.int64), mask=(j < TOTAL) & fixed)
        if PAGE_SIZE > 0:
            _store_rows(pt_ptr, rows_ptr, stride_pt, b, TOTAL, j, token, (j < TOTAL) & fixed, token < n, PAGE_SIZE)
    if n > TOTAL:
        key = tl.load(keys_ptr + b.to(tl.int64) * L + offs, mask=middle, other=-2147483648)
        t, ties = _threshold(hist_ptr, b, BUDGET)
        i = tl.arange(0, BLOCK_N)
        before = i < blk
        counts = counts_ptr + b * n_blocks * 2 + i * 2
        taken = tl.sum(tl.load(counts, mask=before, other=0), 0)  # keys > t in earlier blocks
        tied = tl.sum(tl.load(counts + 1, mask=before, other=0), 0)  # keys == t in earlier blocks
        taken += tl.minimum(tied, ties)
        eq = (middle & (key == t)).to(tl.int32)
        pick = (middle & ((key > t) | ((eq > 0) & (tied + tl.cumsum(eq, 0) - eq < ties)))).to(tl.int32)
        slot = SINK + taken + tl.cumsum(pick, 0) - pick
        put = (pick > 0) & (slot < SINK + BUDGET)  # always, for a settled t: a guard against writing past the row
        tl.store(out + slot, offs.to(tl.int64), mask=put)
        if PAGE_SIZE > 0:
            _store_rows(pt_ptr, rows_ptr, stride_pt, b, TOTAL, slot, offs, put, put, PAGE_SIZE)


def _store_rows(pt_ptr, rows_ptr, stride_pt, b, TOTAL: tl.constexpr, slot, token, store, counted,
                PAGE_SIZE: tl.constexpr):
    """Row b's pool rows at `slot` where `store`: the token's row where `counted`, else -1."""
    page = tl.load(pt_ptr + b.to(tl.int64) * stride_pt + token // PAGE_SIZE, mask=store & counted, other=0)
    row = tl.where(counted, page * PAGE_SIZE + token % PAGE_SIZE, -1)
    tl.store(rows_ptr + b.to(tl.int64) * TOTAL + slot, row.to(tl.int32), mask=store)
