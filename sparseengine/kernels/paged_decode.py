"""Decode attention (one query token per request) over the paged KV cache.

Triton path: split-K flash decoding. Each request's KV range is cut into chunks; one
program per (request, KV head, chunk) loads the g query heads of the group (GQA: K/V are
read once for the whole group), runs an online softmax over the chunk in fp32 and writes a
partial (normalised output, log-sum-exp). One chunk writes the output directly; several
are merged per (request, query head) (`split_merge.py`) by a second kernel (the default,
see `MERGE_IN_SPLIT_KERNEL`) or by the last program of the row to finish: each program with
items counts itself in on the row's int32 counter (an acq_rel atomic, after a barrier so
that all of its partial stores come first); the one that sees `n_active - 1` merges and
zeros the counter for the next launch. The counters are the caller's (`counters`: the
Triton provider keeps one buffer per engine and device, at a fixed address that CUDA-graph
replays reuse), else one shared buffer per device, which launches running at once on two
streams of one device must not share.

The grid depends only on static shapes, so the launch is CUDA-graph safe. The plan
(`split_plan.py`) takes fixed chunks (the grid covers the page table's capacity) for few
rows; for more rows, each row cuts its own length (read on the device) into a few chunks,
and rows that fill the GPU on their own into one or two, so a short row in a wide page
table costs no empty programs. Those per-row plans run balanced (`balanced_plan.py`): one
chunk length for the batch, read on the device, so a ragged batch's long row takes more
programs (a flat grid of `rows * (num_splits + 1)` programs). With fixed
chunks and very few rows (`fine_splits_for`), a row too short to fill its share of
chunks cuts its own length finer (SnapKV's compacted rows in a graph table sized for
max_model_len: 1 x 2304 tokens 9 us against 51). A split past its row's items writes no
partial, and the merge skips partials of weight 0. The same split
kernel serves the sparse variants (`sparse_decode.py`: token, page or pool-row selections)
and the H2O column sums and OmniKV's scores (`attention_colsum.py`, `omnikv_scores.py`:
it can store logits). The kernel itself is in `paged_decode_kernels.py`.
"""
from __future__ import annotations

import torch

from . import _common, balanced_plan, pdl
from ._common import LOG2E, check_cache, check_launch, next_pow2
from .paged_decode_kernels import _decode_split_kernel
from .split_merge import _combine_splits_kernel
from .split_plan import fine_splits_for, min_chunk_for, split_plan

MODE_DENSE, MODE_TOKENS, MODE_PAGES, MODE_ROWS = 0, 1, 2, 3
# What the split kernel writes: partials only (a combine kernel follows), partials then the
# last program merges, or the output itself (one split).
_PARTIALS, _LAST_MERGES, _DIRECT = 0, 1, 2
MAX_SPLIT_COUNTERS = 1 << 16
# With the group's max logits stored (OmniKV's and DeltaKV's filter layers) over fixed chunks
# of at most MAX_MAXIMA_TILES tiles, whether a program keeps its chunk's maxima in the dot's
# register layout, a row a tile, and stores them once after its loop (read at each call;
# False, and for a row's own chunks or longer ones: a store a tile, whose layout change goes
# through shared memory, two barriers a tile). Session 31 (results/omnikv_filter_rows_s31.jsonl):
# OmniKV b=6 filter layers 815 us against 835; 8 tiles held at a time for a row's own chunks
# (DeltaKV b=20, 5e99455) moved its filter layers 2818 us against 2821, graph step 35.822 ms
# against 35.766: not kept.
KEEP_GROUP_MAXIMA = True
MAX_MAXIMA_TILES = 32  # 16 registers a thread at tiles of 64, 4 warps
# Auto merge of several splits: in the split kernel (last program of a row) or in a second
# kernel. Side by side on the H200, vanilla b=1 at 128K in a CUDA graph (commit 1272974,
# results/profile_vanilla_b1{,_merge}_h200.json): two kernels 4.03 + 0.20 ms per step, graph
# step 8.84 ms; merged in the split kernel 4.60 ms, step 9.30 ms. So the second kernel is
# the default; one split writes the output directly.
MERGE_IN_SPLIT_KERNEL = False
# The merge kernel's programs each take one query row's COMBINE_D_TILE channels (None: all
# of them, one program per row): at batch 1 a row per program is only B * Hq = 32 programs.
# Vanilla b=1 at 128K on the H200 (commit 3b57167, results/merge_tile_pdl_ab_h200.jsonl):
# the merges took 0.09 ms per step against 0.18 a row per program; graph step 8.68 vs 8.86 ms.
COMBINE_D_TILE: int | None = 32
# Under the balanced plan the merge reads 4096 / tile partials at once (a ragged batch's long
# row has many more chunks than num_splits); False: num_splits at a time, as other plans.
# H200, one call (session 17, results/profile_vanilla_mix1k_b64_wide*_c9541bd_h200.json):
# vanilla at 1 x 128K + 63 x 1K, batch 64: merges 705 against 1432 us a step, graph step
# 13.57 against 14.65 ms; SnapKV at batch 183 (no merge launches) unchanged.
WIDE_BALANCED_MERGE = True
# Tried and not kept (session 21, 7d1a140, results/tried_not_kept_h200.jsonl): over a selection,
# looking each tile's cache rows up a tile ahead and loading its V beside its K. Quest's 129
# pages at 6 x 8 rows took 26.9 us a launch against 21.1-21.9 (the compiler's own pipelining
# of the selection load lost, more registers live); its b=6 step 8.580 ms against 8.456.


def paged_decode_ref(q, k_cache, v_cache, page_table, kv_lens, scale=None, return_lse=False):
    """q `[B, Hq, d]` -> out `[B, Hq, d]` (and lse `[B, Hq]` fp32, natural log)."""
    B, Hq, d = q.shape
    _, Hkv = check_cache(k_cache, Hq, d)
    g, scale = Hq // Hkv, _common.default_scale(d, scale)
    out = torch.zeros(B, Hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq), float("-inf"), device=q.device)
    for b in range(B):
        tokens = torch.arange(int(kv_lens[b]), device=q.device)
        k = _common.gather_tokens(k_cache, page_table[b], tokens)
        v = _common.gather_tokens(v_cache, page_table[b], tokens)
        for h in range(Hkv):
            heads = slice(h * g, (h + 1) * g)
            out[b, heads], lse[b, heads] = _common.attend(q[b, heads], k[:, h], v[:, h], scale)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def paged_decode_triton(q, k_cache, v_cache, page_table, kv_lens, scale=None, return_lse=False,
                        *, kv_chunk=None, balanced=None, counters=None):
    """Same contract as `paged_decode_ref`; `kv_chunk` (power of two) overrides the split
    size; `balanced`, `counters`: `split_k_decode`'s."""
    capacity = page_table.shape[1] * k_cache.shape[1]
    return split_k_decode(q, k_cache, v_cache, page_table, kv_lens, mode=MODE_DENSE, capacity=capacity,
                          scale=scale, return_lse=return_lse, kv_chunk=kv_chunk, balanced=balanced,
                          counters=counters)


def split_k_decode(q, k_cache, v_cache, page_table, kv_lens, *, mode, capacity, sel=None, num_sel=None,
                   scale=None, return_lse=False, kv_chunk=None, logits=None, logits_group_max=False,
                   logits_all_heads=False, block_n=64, num_warps=None, num_stages=2, fused_combine=None,
                   row_splits=None, fine_splits=None, min_chunk=None, balanced=None, plan_out=None, counters=None):
    """Launch the split kernel (+ merge). `capacity` = static upper bound of items per row.

    mode DENSE: items are tokens 0..kv_len-1. TOKENS: `sel [B, Hkv, K]` token ids, `num_sel
    [B, Hkv]` valid entries. PAGES: `sel [B, Hkv, P]` logical pages, `num_sel` valid pages.
    `logits [B, Hq, L]` fp32 (optional, DENSE only) receives the log2-domain scaled scores;
    with `logits_group_max`, `logits [B, Hkv, L]` receives per KV head the max over its
    query heads of the scaled logit `q . k * scale` (natural units; OmniKV's scores); with
    `logits_all_heads` too, `logits [B, 1, L]` receives the max over all query heads, each
    KV head's program taking its group's max in atomically (the caller fills it with -inf).
    `block_n`, `num_warps`, `num_stages`: launch tuning (bench_gpu sweeps them); `num_warps`
    None: `balanced_plan.split_warps`.
    `fused_combine`: True merges in the split kernel, False launches the combine kernel,
    None (auto): ``MERGE_IN_SPLIT_KERNEL`` (if rows <= counters); one split always writes the
    output directly.
    `row_splits`: each row cuts its own length into this many chunks (default: `split_plan`).
    `fine_splits`: with fixed chunks, a row whose length would fill fewer than this many
    takes chunks of `ceil(len / fine_splits)` rounded up to whole blocks instead (a short row in a
    wide page table, e.g. SnapKV's compacted rows in a graph sized for max_model_len, is
    spread over the GPU instead of one or two chunk programs); 0 turns it off. Default: on
    in the auto plan (`want_splits`), off when `kv_chunk` or `row_splits` is given.
    `min_chunk`: with per-row chunks, no chunk shorter than this many items (a short row
    takes fewer of the splits; `min_chunk_for`); default on in the auto plan for rows that
    fill the GPU, 0 turns it off.
    `counters`: the per-row arrival counters of a launch that merges in the split kernel
    (int32 zeros on q's device, at least B * Hkv; each launch leaves them at zero): the
    caller's own, so that two engines replaying on two streams of one device do not share
    them; default the device's shared buffer (`MAX_SPLIT_COUNTERS`).
    `balanced`: True runs the balanced plan over `B * Hkv * (num_splits + 1)` programs
    (`balanced_plan.py`: one chunk length for the batch, so a row far longer than the
    others takes more chunks, not longer ones); None (auto): where the auto plan cuts each
    row by its own length; False never.
    """
    B, Hq, d = q.shape
    page_size, Hkv = check_cache(k_cache, Hq, d)
    device = check_launch(q, k_cache, v_cache, page_table, kv_lens)
    _common.check_dtypes(q, k_cache, v_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    g, rows = Hq // Hkv, B * Hkv
    chunk, num_splits = split_plan(capacity, rows, device, kv_chunk, row_splits)
    auto = kv_chunk is None and row_splits is None
    fine = fine_splits_for((chunk, num_splits), rows, device, auto, fine_splits)
    least = min_chunk_for((chunk, num_splits), rows, device, auto, min_chunk)
    balanced = balanced_plan.use_balanced(balanced, chunk, auto, rows)
    if chunk and not balanced:  # fixed chunks: the grid covers `capacity`
        block_n = min(chunk, block_n)
    combine = _combine_mode(fused_combine, num_splits, rows, balanced)
    num_warps = num_warps or balanced_plan.split_warps(balanced, rows, device)
    # Partials: a (row, split) grid's at [B, Hq, num_splits]; the balanced plan's at [chunk, group
    # head], at most rows * num_splits + rows chunks (each row rounds its count up once).
    slots = (rows * num_splits + rows) * g if balanced else B * Hq * num_splits
    part_out = _common.empty((slots, d), torch.float32, device)
    part_lse = _common.empty((slots,), torch.float32, device)
    meta = balanced_plan.plan_buffer(plan_out, rows, device) if balanced else balanced_plan.no_plan(plan_out, kv_lens)
    out = _common.empty((B, Hq, d), q.dtype, device)
    lse = _common.empty((B, Hq), torch.float32, device) if return_lse else part_lse
    if counters is not None:
        _common.check_counters(counters, rows, device, f"B * Hkv = {rows}")
    if combine != _LAST_MERGES:
        counters = kv_lens  # unread
    elif counters is None:
        counters = _common.zeroed_counters("split_k_decode", MAX_SPLIT_COUNTERS, device)
    has_sel = sel is not None
    sel_t = sel if has_sel else kv_lens
    num_sel_t = num_sel if has_sel else kv_lens
    logits_t = logits if logits is not None else part_lse
    if logits_all_heads and not logits_group_max:
        raise ValueError("logits_all_heads=True is the max over every group's max: it needs logits_group_max=True")
    store_logits = 0 if logits is None else 3 if logits_all_heads else 2 if logits_group_max else 1
    merge_args = dict(HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_S=min(64, next_pow2(num_splits)),
                      STORE_LSE=return_lse)
    grid = (rows * (num_splits + 1),) if balanced else (rows, num_splits)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, page_table, kv_lens, sel_t, num_sel_t, part_out, part_lse, logits_t,
        out, lse, counters, meta, _common.default_scale(d, scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        sel_t.stride(0) if has_sel else 0, sel_t.stride(1) if has_sel else 0,
        num_sel_t.stride(0) if has_sel else 0, num_sel_t.stride(1) if has_sel else 0,
        out.stride(0), out.stride(1),
        num_splits, fine, least, logits.shape[-1] if logits is not None else 0,
        Hkv, Hq, rows,
        GROUP=g, BLOCK_H=max(16, next_pow2(g)), PAGE_SIZE=page_size, CHUNK=chunk, BLOCK_N=block_n,
        MODE=mode, STORE_LOGITS=store_logits, DOT_PREC=_common.dot_precision(q.dtype),
        COMBINE=combine, FINE=fine > 0, BALANCED=balanced,
        BLOCK_R=min(next_pow2(rows), balanced_plan.BALANCED_ROW_BLOCK) if balanced else 1,
        SLACK=balanced_plan.BALANCED_SLACK,
        **_maxima_tiles(store_logits, chunk, block_n, balanced),
        **merge_args, num_warps=num_warps, num_stages=num_stages,
    )
    if combine == _PARTIALS:  # a program per (query row, COMBINE_D_TILE channels): more programs than rows
        tile = min(merge_args["BLOCK_D"], COMBINE_D_TILE or merge_args["BLOCK_D"])
        _combine_splits_kernel[(B * Hq, merge_args["BLOCK_D"] // tile)](
            part_out, part_lse, out, lse, meta, num_splits, out.stride(0), out.stride(1), Hq,
            **dict(merge_args, BLOCK_D=tile, BLOCK_S=_merge_block_s(tile, num_splits, balanced)), GROUP=g,
            BALANCED=balanced, TRIGGER=pdl.trigger_arg(device), num_warps=4,
        )
    return (out, lse) if return_lse else out


def _maxima_tiles(store_logits: int, chunk: int, block_n: int, balanced: bool) -> dict:
    """LOGIT_TILES: the register rows in which a program holds its chunk's group maxima
    (`KEEP_GROUP_MAXIMA`), 0 for a store a tile."""
    tiles = chunk // block_n if chunk and not balanced else 0
    keep = store_logits >= 2 and KEEP_GROUP_MAXIMA and 0 < tiles <= MAX_MAXIMA_TILES
    return dict(LOGIT_TILES=next_pow2(tiles) if keep else 0)


def _merge_block_s(tile: int, num_splits: int, balanced: bool) -> int:
    """Partials the merge kernel reads at once. A row holds at most num_splits of them,
    except under the balanced plan, where a row far longer than the rest takes as many
    chunks as it needs (a 128K row beside 1K ones at batch 64: 293 chunks where num_splits
    is 8), read in as few passes as the merge's 4096-float tile allows."""
    if balanced and WIDE_BALANCED_MERGE:
        return 4096 // tile
    return min(4096 // tile, next_pow2(num_splits))


def _combine_mode(fused_combine: bool | None, num_splits: int, rows: int, balanced: bool) -> int:
    """How the launch's partials are merged. One split a row writes the output directly;
    under the balanced plan a row may still take several chunks (a ragged batch), so with
    one split a row the auto choice merges in the split kernel (no merge launch for the
    usual one-chunk rows)."""
    if fused_combine is False:
        return _PARTIALS
    if num_splits == 1 and not balanced:
        return _DIRECT
    if fused_combine is None and not MERGE_IN_SPLIT_KERNEL and not (balanced and num_splits == 1):
        return _PARTIALS
    if rows <= MAX_SPLIT_COUNTERS:
        return _LAST_MERGES
    if fused_combine:
        raise ValueError(f"fused_combine needs B * Hkv <= {MAX_SPLIT_COUNTERS} counters, got {rows} rows")
    return _PARTIALS
