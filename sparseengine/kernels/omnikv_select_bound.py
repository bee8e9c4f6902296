"""OmniKV's token pick through a lower bound on its threshold: three launches, no memset.

`pick_by_bound` has the contract of `omnikv_select.omnikv_select_triton`, which calls it
when asked (`bound=True`, or `omnikv_select.BOUND`): the same tokens, counts and pool
rows, ties to the earlier token. The radix pick it stands beside takes a memset and six
launches, four of them passes over every middle key; this one reads the keys once for a
bound, once more to count, and once to write the few that can be picked.

How, for a request of n > total tokens (its middle tokens [sink, n - recent)):
1. `_bound_keys_kernel`, a program per block of tokens: each middle token's key (the max over
   heads, as the radix pick makes it), the block's keys written, and the largest key of
   each group of `GROUP` tokens. The request's last program to arrive finds a lower bound
   on the budget-th largest of those group maxima (its top two bytes, the rest zero).
   The group maxima are keys of distinct middle tokens, so at least `budget` middle keys
   lie at or above the bound: the budget-th largest middle key t does too, and so does
   every key the pick takes. With scores of no special order about 2% of the middle
   tokens are such candidates at the 128K benchmark's shape (1472 of ~130K picked).
2. `_bound_count_kernel`: each block counts its candidates.
3. `_bound_emit_kernel`: each block writes its candidates (key and token) to the request's list
   at the offset the counts of the blocks before it give, so the list ascends; block 0
   writes the sink and recent slots and the count. The last program to arrive finds t and
   the ties to take from the list (radix, a byte a pass, in chunks) and writes the picks
   at their ranks. Keys all equal make every middle token a candidate: still exact, slower.
The last-arrival counters are zeroed once and left at zero by each launch (CUDA-graph
replays reuse them); they are shared by the device's callers, so two launches running at
once on two streams of one device must not both use this pick.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._common import cdiv, lazy_jit, next_pow2, zeroed_counters
from .omnikv_select import omnikv_block, omnikv_fixed_slots, omnikv_keys, omnikv_store_rows

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl

GROUP = 64  # tokens a group maximum covers (fewer when a block is smaller)
CHUNK = 4096  # list entries the last program handles at a time
MAX_ROWS = 4096  # requests a launch (its arrival counters); more go to the radix pick


def pick_by_bound(scores, kv_lens, sink: int, budget: int, recent: int, block: int, num_warps: int,
                  page_table=None, page_size: int = 0):
    """`scores [B, H, L]` (stride 1 along L), checked by the caller, which also answers a
    width within the total; returns what `omnikv_select_triton` returns."""
    B, H, L = scores.shape
    device = scores.device
    total = sink + budget + recent
    n_blocks = cdiv(L, block)
    group = min(GROUP, block)
    keys = torch.empty((B, L), dtype=torch.int32, device=device)
    maxima = torch.empty((B, n_blocks * (block // group)), dtype=torch.int32, device=device)
    bounds = torch.empty((B,), dtype=torch.int32, device=device)
    block_counts = torch.empty((B, n_blocks), dtype=torch.int32, device=device)
    cand_keys = torch.empty((B, L), dtype=torch.int32, device=device)
    cand_tokens = torch.empty((B, L), dtype=torch.int32, device=device)
    indices = torch.empty((B, total), dtype=torch.int64, device=device)
    counts = torch.empty((B,), dtype=torch.int32, device=device)
    with_rows = page_table is not None
    rows = torch.empty((B, total), dtype=torch.int32, device=device) if with_rows else indices
    counters = zeroed_counters("omnikv_select_bound", MAX_ROWS, device)
    grid = (B, n_blocks)
    common = dict(SINK=sink, BUDGET=budget, RECENT=recent, BLOCK=block, num_warps=num_warps)
    _bound_keys_kernel[grid](scores, kv_lens, keys, maxima, bounds, counters, scores.stride(0), scores.stride(1),
                             L, n_blocks, H=H, GROUP=group, CHUNK=CHUNK, **common)
    _bound_count_kernel[grid](keys, bounds, kv_lens, block_counts, L, n_blocks, **common)
    _bound_emit_kernel[grid](keys, bounds, kv_lens, block_counts, cand_keys, cand_tokens, counters, indices, counts,
                             L, n_blocks, page_table if with_rows else kv_lens, rows,
                             page_table.stride(0) if with_rows else 0, PAGE_SIZE=page_size if with_rows else 0,
                             BLOCK_N=next_pow2(n_blocks), BLOCK_K=next_pow2(total), CHUNK=CHUNK, **common)
    return (indices, counts, rows) if with_rows else (indices, counts)


def _kth_largest(keys_ptr, count, k, PASSES: tl.constexpr, CHUNK: tl.constexpr):
    """(t, ties): over the int32 keys `keys_ptr[0 : count]`, the top 8 * PASSES bits of the
    k-th largest (the rest zero: a lower bound on it, exact after four passes) and how
    many keys matching them the k largest still need (after four: the keys equal to t to
    take). A byte a pass, each pass a histogram of the keys that match the bytes so far:
    the first CHUNK keys loaded once and kept, any further ones loaded each pass, CHUNK at
    a time. Loads bypass L1, for other programs of this launch wrote the keys."""
    first = tl.arange(0, CHUNK)
    kept = (tl.load(keys_ptr + first, mask=first < count, other=0, cache_modifier=".cg") ^ -2147483648).to(
        tl.uint32, bitcast=True)
    prefix = tl.zeros([], tl.uint32)
    need = k + tl.zeros([], tl.int32)
    digits = tl.arange(0, 256)
    for p in tl.static_range(PASSES):
        h = tl.histogram(_digit(kept, p), 256, mask=_matching(kept, first < count, prefix, p))
        for c0 in range(CHUNK, count, CHUNK):
            offs = c0 + first
            valid = offs < count
            u = (tl.load(keys_ptr + offs, mask=valid, other=0, cache_modifier=".cg") ^ -2147483648).to(
                tl.uint32, bitcast=True)
            h += tl.histogram(_digit(u, p), 256, mask=_matching(u, valid, prefix, p))
        at_least = tl.cumsum(h, 0, reverse=True)  # matching keys with this byte or a larger one
        d = tl.max(tl.where(at_least >= need, digits, 0), 0)  # byte 0 always qualifies
        need -= tl.sum(tl.where(digits > d, h, 0), 0)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * p))
    return prefix.to(tl.int32, bitcast=True) ^ -2147483648, need


def _digit(u, p: tl.constexpr):
    """Byte p (0: the top one) of the uint32 keys `u`."""
    return ((u >> (24 - 8 * p)) & 255).to(tl.int32)


def _matching(u, valid, prefix, p: tl.constexpr):
    """The valid keys whose top p bytes are those of `prefix`."""
    if p == 0:
        return valid
    return valid & ((u >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))


def _arrive(counter, n_blocks):
    """Whether this program is the last of its request to arrive (after a barrier, so all
    of its stores come first; the acquire then sees every program's)."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_blocks - 1


@lazy_jit
def _bound_keys_kernel(scores_ptr, kv_lens_ptr, keys_ptr, maxima_ptr, bounds_ptr, counter_ptr, stride_b, stride_h,
                       L, n_blocks, H: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr,
                       SINK: tl.constexpr, BUDGET: tl.constexpr, RECENT: tl.constexpr, BLOCK: tl.constexpr):
    G: tl.constexpr = BLOCK // GROUP
    b, offs, middle, n = omnikv_block(kv_lens_ptr, L, SINK, RECENT, BLOCK)
    if n > SINK + BUDGET + RECENT:  # else the request takes every token: no search
        key = omnikv_keys(scores_ptr + b.to(tl.int64) * stride_b, stride_h, offs, middle, H)
        tl.store(keys_ptr + b.to(tl.int64) * L + offs, key, mask=offs < L)
        n_max = n_blocks * G
        tl.store(maxima_ptr + b * n_max + tl.program_id(1) * G + tl.arange(0, G),
                 tl.max(tl.reshape(key, [G, GROUP]), 1))
        counter = counter_ptr + b
        if _arrive(counter, n_blocks):
            bound, _ = _kth_largest(maxima_ptr + b * n_max, n_max, BUDGET, 2, CHUNK)
            tl.store(bounds_ptr + b, bound)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@lazy_jit
def _bound_count_kernel(keys_ptr, bounds_ptr, kv_lens_ptr, counts_ptr, L, n_blocks,
                        SINK: tl.constexpr, BUDGET: tl.constexpr, RECENT: tl.constexpr, BLOCK: tl.constexpr):
    b, offs, middle, n = omnikv_block(kv_lens_ptr, L, SINK, RECENT, BLOCK)
    if n > SINK + BUDGET + RECENT:
        key = tl.load(keys_ptr + b.to(tl.int64) * L + offs, mask=middle, other=-2147483648)
        bound = tl.load(bounds_ptr + b)
        tl.store(counts_ptr + b * n_blocks + tl.program_id(1), tl.sum((middle & (key >= bound)).to(tl.int32), 0))


@lazy_jit
def _bound_emit_kernel(keys_ptr, bounds_ptr, kv_lens_ptr, counts_ptr, cand_keys_ptr, cand_tokens_ptr, counter_ptr,
                       out_ptr, n_out_ptr, L, n_blocks, pt_ptr, rows_ptr, stride_pt,
                       PAGE_SIZE: tl.constexpr, SINK: tl.constexpr, BUDGET: tl.constexpr, RECENT: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    TOTAL: tl.constexpr = SINK + BUDGET + RECENT
    b, offs, middle, n = omnikv_block(kv_lens_ptr, L, SINK, RECENT, BLOCK)
    blk = tl.program_id(1)
    out = out_ptr + b.to(tl.int64) * TOTAL
    if blk == 0:
        omnikv_fixed_slots(n_out_ptr, out, pt_ptr, rows_ptr, stride_pt, b, n, PAGE_SIZE, SINK, BUDGET, RECENT,
                           BLOCK_K)
    if n > TOTAL:
        key = tl.load(keys_ptr + b.to(tl.int64) * L + offs, mask=middle, other=-2147483648)
        cand = (middle & (key >= tl.load(bounds_ptr + b))).to(tl.int32)
        i = tl.arange(0, BLOCK_N)
        block_counts = tl.load(counts_ptr + b * n_blocks + i, mask=i < n_blocks, other=0)
        at = tl.sum(tl.where(i < blk, block_counts, 0), 0) + tl.cumsum(cand, 0) - cand
        row = b.to(tl.int64) * L
        tl.store(cand_keys_ptr + row + at, key, mask=cand > 0)
        tl.store(cand_tokens_ptr + row + at, offs, mask=cand > 0)
        counter = counter_ptr + b
        if _arrive(counter, n_blocks):
            listed = tl.sum(block_counts, 0)
            t, ties = _kth_largest(cand_keys_ptr + row, listed, BUDGET, 4, CHUNK)
            taken = tl.zeros([], tl.int32)
            tied = tl.zeros([], tl.int32)
            for c0 in range(0, listed, CHUNK):
                j = c0 + tl.arange(0, CHUNK)
                valid = j < listed
                k = tl.load(cand_keys_ptr + row + j, mask=valid, other=-2147483648, cache_modifier=".cg")
                token = tl.load(cand_tokens_ptr + row + j, mask=valid, other=0, cache_modifier=".cg")
                eq = (valid & (k == t)).to(tl.int32)
                pick = (valid & ((k > t) | ((eq > 0) & (tied + tl.cumsum(eq, 0) - eq < ties)))).to(tl.int32)
                slot = SINK + taken + tl.cumsum(pick, 0) - pick
                put = (pick > 0) & (slot < SINK + BUDGET)  # always so: the mask only keeps stores in the row
                tl.store(out + slot, token.to(tl.int64), mask=put)
                if PAGE_SIZE > 0:
                    omnikv_store_rows(pt_ptr, rows_ptr, stride_pt, b, TOTAL, slot, token, put, put, PAGE_SIZE)
                taken += tl.sum(pick, 0)
                tied += tl.sum(eq, 0)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
