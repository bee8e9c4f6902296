"""OmniKV's token pick on the GPU: sink + top-`budget` + recent, no sort.

`omnikv_select_triton(scores, kv_lens, sink_tokens, budget, recent_tokens)` has the
contract of `sparseengine.methods.omnikv.pick_tokens` (the torch path), with the max over
heads folded in: `scores [B, H, L]` (a filter layer's per-KV-head max logits) or `[B, L]`,
any float dtype; entries at or past `kv_lens[b] - recent` are never read as candidates ->
`(indices [B, K]` int64, `counts [B]` int32), `K = sink + budget + recent`. A request of
`n > K` tokens gets `[0, sink)`, the top `budget` of its middle tokens `[sink, n - recent)`
ascending, then `[n - recent, n)`; a shorter one gets `0 .. K-1` with count n. Ties go to
the earlier token, which `torch.topk` does not promise.

How (two launches, no host sync, CUDA-graph capturable):
1. `_keys_kernel`, a program per (request, block of tokens): the max over heads, mapped to
   an int32 key of the same order (negative floats flip their low 31 bits; -0.0 counts as
   +0.0), the minimum int32 outside the middle; writes the keys and each group of `group`
   tokens' largest key.
2. `_pick_kernel`, a program per request: L = the budget-th largest group maximum. At least
   `budget` middle keys are >= L, so every key the pick takes (ties included) is >= L: the
   groups whose maximum reaches L (usually few more than `budget`) are listed, and their
   keys >= L gathered in token order into a per-request scratch of `cap` slots. The exact
   threshold t among those (a radix search, 8 key bits a pass, each pass one
   `tl.histogram`) leaves the number of keys equal to t still to take; one pass writes the
   keys > t and the earliest such ties at their rank (an exclusive `tl.cumsum`), so the
   output is ascending. A request with more than `cap` candidates (many equal scores) runs
   the same search and pass over all its keys instead.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._common import cdiv, check_launch, int_arg, lazy_jit, next_pow2

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


def omnikv_select_triton(scores, kv_lens, sink_tokens, budget, recent_tokens, *, group: int = 16,
                         block: int = 1024, search_block: int = 4096, cap: int | None = None,
                         num_warps: int = 8):
    """`group`: tokens per group maximum (a power of two); `block`: tokens per program of the
    keys pass (a power of two, a multiple of `group`); `search_block`: keys a block of the
    pick's passes; `cap`: the candidates' room (a power of two >= 16; default
    `next_pow2(2 * budget)` within [16, 8192])."""
    if not isinstance(scores, torch.Tensor) or scores.dim() not in (2, 3) or not scores.is_floating_point():
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        dtype = f", dtype {scores.dtype}" if isinstance(scores, torch.Tensor) else ""
        raise ValueError(f"scores must be a floating [B, L] or [B, H, L] tensor, got {got}{dtype}")
    if scores.dim() == 2:
        scores = scores[:, None, :]
    B, H, L = scores.shape
    if (not isinstance(kv_lens, torch.Tensor) or kv_lens.dim() != 1 or kv_lens.shape[0] != B
            or kv_lens.is_floating_point() or kv_lens.dtype == torch.bool):
        got = (f"shape {tuple(kv_lens.shape)}, dtype {kv_lens.dtype}" if isinstance(kv_lens, torch.Tensor)
               else type(kv_lens).__name__)
        raise ValueError(f"kv_lens must be an integer [B={B}] tensor, got {got}")
    sink = int_arg("sink_tokens", sink_tokens, 0)
    budget = int_arg("budget", budget, 0)
    recent = int_arg("recent_tokens", recent_tokens, 0)
    for name, value in (("group", group), ("block", block), ("search_block", search_block)):
        if int_arg(name, value, 2) & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if block % group:
        raise ValueError(f"block ({block}) must be a multiple of group ({group})")
    cap = cap or min(8192, max(16, next_pow2(2 * budget)))
    if int_arg("cap", cap, 16) & (cap - 1):
        raise ValueError(f"cap must be a power of two >= 16, got {cap}")
    device = check_launch(scores, kv_lens)
    total = sink + budget + recent
    everything = torch.arange(total, device=device).expand(B, total)
    counts = kv_lens.clamp(max=total).to(torch.int32)
    if L <= total or B == 0:  # no request can hold more than the total
        return everything, counts
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    n_groups = cdiv(L, group)
    keys = torch.empty((B, L), dtype=torch.int32, device=device)
    gmax = torch.empty((B, n_groups), dtype=torch.int32, device=device)
    listed = torch.empty((B, n_groups), dtype=torch.int32, device=device)
    scratch = torch.empty((B, 2, cap), dtype=torch.int32, device=device)
    indices = torch.empty((B, total), dtype=torch.int64, device=device)
    _keys_kernel[(B, cdiv(L, block))](
        scores, kv_lens, keys, gmax, scores.stride(0), scores.stride(1), L, n_groups,
        H=H, SINK=sink, RECENT=recent, GROUP=group, BLOCK=block, num_warps=4)
    _pick_kernel[(B,)](
        keys, gmax, listed, scratch, kv_lens, indices, L, n_groups,
        SINK=sink, BUDGET=budget, RECENT=recent, GROUP=group, BLOCK=search_block,
        BLOCK_Q=max(1, search_block // group), BLOCK_K=next_pow2(total), CAP=cap, num_warps=num_warps)
    return indices, counts


def _ordered_keys(s):
    """int32 keys of fp32 `s`, ordered as the floats; -0.0 is +0.0."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@lazy_jit
def _keys_kernel(scores_ptr, kv_lens_ptr, keys_ptr, gmax_ptr, stride_b, stride_h, L, n_groups,
                 H: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(kv_lens_ptr + b).to(tl.int32)
    middle = (offs >= SINK) & (offs < n - RECENT) & (offs < L)
    row = scores_ptr + b.to(tl.int64) * stride_b
    s = tl.load(row + offs, mask=middle, other=float("-inf")).to(tl.float32)
    for h in range(1, H):
        s = tl.maximum(s, tl.load(row + h * stride_h + offs, mask=middle, other=float("-inf")).to(tl.float32))
    key = tl.where(middle, _ordered_keys(s), -2147483648)
    tl.store(keys_ptr + b.to(tl.int64) * L + offs, key, mask=offs < L)
    g = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
    tl.store(gmax_ptr + b.to(tl.int64) * n_groups + g, tl.max(tl.reshape(key, [BLOCK // GROUP, GROUP]), 1),
             mask=g < n_groups)


def _kth_largest(src, n_items, m, BLOCK: tl.constexpr):
    """(t, ties): the m-th largest of the int32 keys `src[0:n_items]` (1 <= m <= n_items),
    and how many keys equal to t the m largest hold. Four passes over the keys in blocks,
    8 bits each, on uint32 (the keys with their sign bit flipped: the same order): a pass
    histograms the next byte of the keys that match the bytes settled so far and keeps the
    largest byte with at least `need` keys at or above it."""
    prefix = tl.zeros([], tl.uint32)
    need = m
    digits = tl.arange(0, 256)
    for p in tl.static_range(4):
        hist = tl.zeros([256], tl.int32)
        for i0 in range(0, n_items, BLOCK):
            offs = i0 + tl.arange(0, BLOCK)
            ok = offs < n_items
            u = (tl.load(src + offs, mask=ok, other=0) ^ -2147483648).to(tl.uint32, bitcast=True)
            if p > 0:
                ok = ok & ((u >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
            hist += tl.histogram(((u >> (24 - 8 * p)) & 255).to(tl.int32), 256, mask=ok)
        at_least = tl.cumsum(hist, 0, reverse=True)  # keys (matching so far) with this byte or a larger one
        d = tl.max(tl.where(at_least >= need, digits, 0), 0)  # byte 0 always qualifies
        need -= tl.sum(tl.where(digits > d, hist, 0), 0)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * p))
    return (prefix.to(tl.int32, bitcast=True) ^ -2147483648), need


def _emit(src_keys, src_pos, n_items, t, ties, out, lo, hi, FROM_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Write, at out[0..], the positions of the keys > t and the first `ties` keys == t among
    `src_keys[0:n_items]` whose positions lie in [lo, hi), in order. Positions: `src_pos`,
    or the key's own index when FROM_ROW."""
    taken = tl.zeros([], tl.int32)
    tied = tl.zeros([], tl.int32)
    for i0 in range(0, n_items, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        if FROM_ROW:
            pos = offs
        else:
            pos = tl.load(src_pos + offs, mask=offs < n_items, other=-1)
        ok = (offs < n_items) & (pos >= lo) & (pos < hi)
        key = tl.load(src_keys + offs, mask=ok, other=-2147483648)
        eq = (ok & (key == t)).to(tl.int32)
        pick = (ok & ((key > t) | ((eq > 0) & (tied + tl.cumsum(eq, 0) - eq < ties)))).to(tl.int32)
        slot = taken + tl.cumsum(pick, 0) - pick
        tl.store(out + slot, pos.to(tl.int64), mask=pick > 0)
        taken += tl.sum(pick, 0)
        tied += tl.sum(eq, 0)


@lazy_jit
def _pick_kernel(keys_ptr, gmax_ptr, listed_ptr, scratch_ptr, kv_lens_ptr, out_ptr, L, n_groups,
                 SINK: tl.constexpr, BUDGET: tl.constexpr, RECENT: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAP: tl.constexpr):
    b = tl.program_id(0)
    TOTAL: tl.constexpr = SINK + BUDGET + RECENT
    out = out_ptr + b.to(tl.int64) * TOTAL
    n = tl.load(kv_lens_ptr + b).to(tl.int32)
    everything = n <= TOTAL
    # Sink and recent slots (every slot when the request is within the total).
    j = tl.arange(0, BLOCK_K)
    fixed = everything | (j < SINK) | (j >= SINK + BUDGET)
    tl.store(out + j, tl.where(everything | (j < SINK), j, n - TOTAL + j).to(tl.int64), mask=(j < TOTAL) & fixed)
    if n > TOTAL:
        keys = keys_ptr + b.to(tl.int64) * L
        gmax = gmax_ptr + b.to(tl.int64) * n_groups
        listed = listed_ptr + b.to(tl.int64) * n_groups
        cand = scratch_ptr + b.to(tl.int64) * (2 * CAP)
        low, _ = _kth_largest(gmax, n_groups, BUDGET, BLOCK)
        # The groups whose largest key reaches `low`, in order.
        n_listed = tl.zeros([], tl.int32)
        for g0 in range(0, n_groups, BLOCK):
            g = g0 + tl.arange(0, BLOCK)
            hit = ((g < n_groups) & (tl.load(gmax + g, mask=g < n_groups, other=-2147483648) >= low)).to(tl.int32)
            tl.store(listed + n_listed + tl.cumsum(hit, 0) - hit, g, mask=hit > 0)
            n_listed += tl.sum(hit, 0)
        tl.debug_barrier()  # this program's stores before its loads
        # Their middle keys >= low, in token order, into the scratch (keys, then positions).
        n_cand = tl.zeros([], tl.int32)
        lane = tl.arange(0, GROUP)
        for q0 in range(0, n_listed, BLOCK_Q):
            q = q0 + tl.arange(0, BLOCK_Q)
            grp = tl.load(listed + q, mask=q < n_listed, other=0)
            pos = tl.reshape(grp[:, None] * GROUP + lane[None, :], [BLOCK_Q * GROUP])
            ok = tl.reshape((q < n_listed)[:, None] & (lane[None, :] >= 0), [BLOCK_Q * GROUP]) & (pos < L)
            key = tl.load(keys + pos, mask=ok, other=-2147483648)
            hit = (ok & (key >= low) & (pos >= SINK) & (pos < n - RECENT)).to(tl.int32)
            slot = n_cand + tl.cumsum(hit, 0) - hit
            keep = (hit > 0) & (slot < CAP)
            tl.store(cand + slot, key, mask=keep)
            tl.store(cand + CAP + slot, pos, mask=keep)
            n_cand += tl.sum(hit, 0)
        tl.debug_barrier()
        if n_cand <= CAP:
            t, ties = _kth_largest(cand, n_cand, BUDGET, CAP)
            _emit(cand, cand + CAP, n_cand, t, ties, out + SINK, SINK, n - RECENT, False, CAP)
        else:  # too many candidates: search every key of the request
            t, ties = _kth_largest(keys, L, BUDGET, BLOCK)
            _emit(keys, keys, L, t, ties, out + SINK, SINK, n - RECENT, True, BLOCK)
