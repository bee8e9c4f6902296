"""Quest's page scores over the page bounds (`quest.py` keeps the bounds).

`quest_page_scores_torch`: the reference's scores, vectorised (one gather of every
request's page bounds, no loop, no host sync).
`quest_page_scores_*(q, kmax, kmin, page_table, kv_lens, page_size)` -> `[B, Hkv,
max_pages]` fp32: `max over the group's query heads of sum_c max(q_c M_c, q_c m_c)`
(unscaled), -inf for logical pages at or past `ceil(kv_lens / page_size)` (the Triton
kernel leaves the tiles wholly past them unwritten: its programs there exit at once, so a
short request in a batch with a 128K page table costs no more than its pages; the
consumers never read past a request's pages); on a decode
step the Triton scoring can fold the step's new keys into their pages' bounds first (one
launch instead of the update's and the scores'), and can give the selection's shortlist
its group maxima from the same launch (`quest_page_scores_and_maxima_triton`). Top-k is
left to `torch.topk`. The Triton kernel casts q to the metadata dtype and computes the
bound as `max(q, 0) . M + min(q, 0) . m` (equal since M >= m): two tensor-core dots per
page tile. `quest_scores_cuda.py` is the CUDA kernel of the same contract.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import _common, pdl
from ._common import cdiv, check_launch, lazy_jit, next_pow2
from .pdl import pdl_wait

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


def quest_page_scores_ref(q, kmax, kmin, page_table, kv_lens, page_size):
    B, Hq, d = q.shape
    Hkv = kmax.shape[1]
    g = Hq // Hkv
    P = page_table.shape[1]
    scores = torch.full((B, Hkv, P), float("-inf"), device=q.device)
    for b in range(B):
        n_pages = cdiv(int(kv_lens[b]), page_size)
        pages = page_table[b, :n_pages].long()
        for h in range(Hkv):
            qg = q[b, h * g:(h + 1) * g].float()[:, None, :]  # [g, 1, d]
            hi, lo = kmax[pages, h].float()[None], kmin[pages, h].float()[None]  # [1, n, d]
            upper = torch.maximum(qg * hi, qg * lo).sum(-1)  # [g, n]
            scores[b, h, :n_pages] = upper.max(0).values
    return scores


def quest_page_scores_torch(q, kmax, kmin, page_table, kv_lens, page_size):
    B, Hq, d = q.shape
    Hkv = kmax.shape[1]
    P = page_table.shape[1]
    pages = page_table.long()
    hi, lo = kmax[pages].float(), kmin[pages].float()  # [B, P, Hkv, d]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, d)
    upper = torch.einsum("bhgd,bphd->bhgp", qg.clamp(min=0), hi)
    upper = upper + torch.einsum("bhgd,bphd->bhgp", qg.clamp(max=0), lo)  # max(qM, qm), as M >= m
    n_pages = (kv_lens.to(q.device).long() + page_size - 1) // page_size
    valid = torch.arange(P, device=q.device)[None, :] < n_pages[:, None]  # [B, P]
    return upper.amax(2).masked_fill(~valid[:, None, :], float("-inf"))


SCORE_BLOCK_P = 64  # pages a tile, the default (results/quest_kernels_h200.jsonl, quest_scores_*_h200.jsonl)
# The launch's defaults, read at each call (profile_decode_step.py --kernel-const sets them for A/Bs):
# tiles a program, its warps and stages.
SCORE_ITERS = 2
SCORE_WARPS = 4
SCORE_STAGES = 2
# Whether a program keeps its tiles' scores (and the group maxima) in registers and stores them
# once after its loop: the max over the group's heads leaves a tile's scores in a slice of the
# dot's layout, and a store a tile moves them through shared memory behind two barriers (as in
# OmniKV's filter layers, session 31). H200, Quest b=6 at 128K (session 32, results/quest_scores_s32.jsonl):
# 52.9 us a launch against 53.4, the page scores 1561 us a step against 1577-1578, graph step
# 8.394 / 8.380 ms against 8.399 / 8.407. Slower there: plain loads with no asynchronous copies
# (`num_stages` 1; 60-69 us); and, removed since, the pages as the dot's rows (the sm_90
# warpgroup MMA; 54-75 us) and each tile's loads issued before the tile before is scored (77-108 us).
KEEP_SCORE_TILES = True
# With the fold: launched as a programmatic dependent launch (sm_90), the first tile's loads issued before the
# program waits for the qkv linear before it (which writes q and the key), the fold after them (`_page_scores`),
# as the CUDA scores (`quest_scores_cuda`) do. Off: written in session 50, not run on a GPU yet (an A/B in
# `gpu_session.sh quest_scores_cuda`); built for sm_90 it takes 168 registers a thread against the default's 64.
SCORE_PDL = False


@dataclass(frozen=True)
class ScoreLaunch:
    """The page scores' launch: `block_p` pages a tile, `iters` tiles a program (a loop the
    compiler pipelines over `num_stages`), `num_warps`, `keep_tiles` (above), `pdl` (True
    needs the fold; None: `SCORE_PDL` where the step's keys are folded). `score_launch()`
    fills what a call leaves out from the module's defaults at that call."""
    block_p: int
    iters: int
    num_warps: int
    num_stages: int | None
    keep_tiles: bool
    pdl: bool | None = None

    def __post_init__(self):
        for name in ("block_p", "iters", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.keep_tiles and self.iters & (self.iters - 1):
            raise ValueError(f"iters must be a power of two when the tiles are kept, got {self.iters}")


def score_launch(block_p=None, iters=None, num_warps=None, num_stages=None, keep_tiles=None,
                 pdl=None) -> ScoreLaunch:
    """A `ScoreLaunch` with each argument left None taken from the module's defaults now
    (`pdl` stays None: `SCORE_PDL` where the launch folds)."""
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return ScoreLaunch(pick(block_p, SCORE_BLOCK_P), pick(iters, SCORE_ITERS), pick(num_warps, SCORE_WARPS),
                       pick(num_stages, SCORE_STAGES), bool(pick(keep_tiles, KEEP_SCORE_TILES)), pdl)


def quest_page_scores_triton(q, kmax, kmin, page_table, kv_lens, page_size, *, k_cache=None, new_slots=None,
                             **launch):
    """`launch`: `score_launch`'s arguments (block_p, iters, num_warps, num_stages, keep_tiles)."""
    return _page_scores(q, kmax, kmin, page_table, kv_lens, page_size, k_cache, new_slots, score_launch(**launch),
                        None)[0]


def quest_page_scores_and_maxima_triton(q, kmax, kmin, page_table, kv_lens, page_size, *, group, sink_pages,
                                        recent_tokens, k_cache=None, new_slots=None, **launch):
    """`quest_page_scores_triton`, and from the same launch the maxima `[B, Hkv, ceil(P /
    group)]` fp32 of each group of `group` pages over the request's middle pages (from
    `sink_pages` on, before the page holding its first recent token: `(n - recent_tokens) //
    page_size`, every page when `recent_tokens` is 0), -inf for a group with none: the
    shortlist's first stage (`quest_select_pages_triton(group_maxima=)`). Only the groups up
    to the request's last page are written. `group` must divide the launch's `block_p`."""
    tiling = score_launch(**launch)
    if not isinstance(group, int) or group < 1 or tiling.block_p % group:
        raise ValueError(f"group must be a positive divisor of block_p={tiling.block_p}, got {group!r}")
    if not isinstance(sink_pages, int) or sink_pages < 0 or not isinstance(recent_tokens, int) or recent_tokens < 0:
        raise ValueError(f"sink_pages and recent_tokens must be ints >= 0, got {sink_pages!r}, {recent_tokens!r}")
    return _page_scores(q, kmax, kmin, page_table, kv_lens, page_size, k_cache, new_slots, tiling,
                        (group, sink_pages, recent_tokens))


def middle_group_maxima_ref(scores, kv_lens, page_size, group, sink_pages, recent_tokens):
    """The torch twin of the maxima above, from `scores [B, Hkv, P]`."""
    B, H, P = scores.shape
    n = kv_lens.to(scores.device).long()
    if recent_tokens:
        recent_first = (n - recent_tokens).clamp(min=0) // page_size
    else:
        recent_first = (n + page_size - 1) // page_size
    p = torch.arange(P, device=scores.device)
    middle = (p[None, :] >= sink_pages) & (p[None, :] < recent_first[:, None])  # [B, P]
    masked = scores.float().masked_fill(~middle[:, None, :], float("-inf"))
    pad = cdiv(P, group) * group - P
    masked = torch.nn.functional.pad(masked, (0, pad), value=float("-inf"))
    return masked.view(B, H, -1, group).amax(-1)


def _page_scores(q, kmax, kmin, page_table, kv_lens, page_size, k_cache, new_slots, launch: ScoreLaunch, middle):
    """`launch`: the tiling (`bench_gpu --quest-select` and `--quest-score-launches` sweep it;
    at the 128K benchmark's shape two tiles of 64 in two stages took 52.6 us a launch against
    57.4 for one tile a program, results/quest_kernels_h200.jsonl, commit 3b57167).

    `k_cache` + `new_slots [B]` (a decode step: request b's newest token, its last at
    `kv_lens[b] - 1`, was written at `new_slots[b]`, -1 for a padding row): first fold that
    key into its page's bounds, as `update_page_minmax_*` would (offset 0 resets the page),
    then score, in the one launch. The program whose tiles hold the request's last page
    does the fold before its loads, so no other program reads that page.

    `launch.pdl` (with the fold only): each tile's loads first, then q, the key and the fold,
    the folded page scored from its new bounds (the tile holds the old ones; its sum runs in
    another order than the dot's: the same scores within rounding); on an sm_90 GPU the
    kernel launches with PDL and waits (griddepcontrol) before q and the key, so its first
    bounds load while the kernel before runs. Safe where that kernel and those before it do
    not write the bounds, page table or lengths: in the fold path no kernel of the step
    writes this layer's bounds (`quest_scores_cuda.py` and `quest_scores.cu`, which load
    their first tile before the wait the same way). Under the interpreter: the order only."""
    B, Hq, d = q.shape
    Hkv = kmax.shape[1]
    device = check_launch(q, kmax, kmin, page_table, kv_lens)
    fold = check_new_keys(k_cache, new_slots, kmax, B, page_size)
    if launch.pdl and not fold:
        raise ValueError("pdl=True needs the fold (k_cache, new_slots): without it the minmax update just before "
                         "writes the bounds the tiles load before the wait")
    late = fold and (SCORE_PDL if launch.pdl is None else launch.pdl)
    wait = late and pdl.available(device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kmax.stride(-1) != 1 or kmin.stride() != kmax.stride():
        raise ValueError("kmax/kmin must share strides with a contiguous last dim")
    g, P = Hq // Hkv, page_table.shape[1]
    scores = _common.empty((B, Hkv, P), torch.float32, device)
    group, sink_pages, recent = middle or (0, 0, 0)
    n_groups = cdiv(P, group) if group else 1
    maxima = _common.empty((B, Hkv, n_groups) if group else (1,), torch.float32, device)
    tuning = {} if launch.num_stages is None else {"num_stages": launch.num_stages}
    block_p, iters = launch.block_p, launch.iters
    k_src = k_cache if fold else kmax  # unread unless folding
    _page_scores_kernel[(B * Hkv, cdiv(P, block_p * iters))](
        q, kmax, kmin, page_table, kv_lens, scores, k_src, new_slots if fold else kv_lens, maxima,
        q.stride(0), q.stride(1), kmax.stride(0), kmax.stride(1), page_table.stride(0),
        k_src.stride(0), k_src.stride(1) if fold else 0, k_src.stride(2) if fold else 0, P, Hkv, n_groups,
        FOLD_NEW=fold, GROUP=g, BLOCK_H=max(16, next_pow2(g)), PAGE_SIZE=page_size, HEAD_DIM=d,
        BLOCK_D=max(16, next_pow2(d)), BLOCK_P=block_p, ITERS=iters, DOT_PREC=_common.dot_precision(kmax.dtype),
        MAX_GROUP=group, SINK_PAGES=sink_pages, RECENT=recent, KEEP=launch.keep_tiles, LATE=late, PDL=wait,
        num_warps=launch.num_warps, **tuning, **({"launch_pdl": True} if wait else {}),
    )
    return scores, (maxima if group else None)


def check_new_keys(k_cache, new_slots, kmax, B: int, page_size: int) -> bool:
    """Whether the scoring folds this step's keys in (both given), after checking them (the
    Triton and CUDA scorings' shared checks)."""
    if (k_cache is None) != (new_slots is None):
        raise ValueError("k_cache and new_slots go together: pass both to fold the step's keys in, or neither")
    if k_cache is None:
        return False
    num_pages, hkv, d = kmax.shape
    if k_cache.dim() != 4 or tuple(k_cache.shape) != (num_pages, page_size, hkv, d):
        raise ValueError(f"k_cache must be [{num_pages}, page_size={page_size}, {hkv}, {d}], got "
                         f"{tuple(k_cache.shape)}")
    if k_cache.stride(-1) != 1 or k_cache.dtype != kmax.dtype:
        raise ValueError(f"k_cache must be contiguous in head_dim and of kmax's dtype {kmax.dtype}, got "
                         f"{k_cache.dtype}")
    if (new_slots.dim() != 1 or new_slots.shape[0] != B or new_slots.is_floating_point()
            or new_slots.dtype == torch.bool):
        raise ValueError(f"new_slots must be an integer [B={B}] tensor (one new token a request), got "
                         f"shape {tuple(new_slots.shape)}, dtype {new_slots.dtype}")
    if k_cache.device != kmax.device or new_slots.device != kmax.device:
        raise ValueError(f"k_cache and new_slots must be on kmax's device {kmax.device}, got {k_cache.device} and "
                         f"{new_slots.device}")
    return True


def _fold_key(k_ptr, kmax_ptr, kmin_ptr, slot, kvh, stride_kp, stride_ko, stride_kh, stride_mp, stride_mh,
              offs_d, d_ok, PAGE_SIZE: tl.constexpr):
    """The step's key (at `slot`) into its page's bounds for head `kvh`, stored; returns them
    (offset 0 starts the page afresh)."""
    page, off = slot // PAGE_SIZE, slot % PAGE_SIZE
    k = tl.load(k_ptr + page * stride_kp + off * stride_ko + kvh * stride_kh + offs_d, mask=d_ok)
    meta = page * stride_mp + kvh * stride_mh + offs_d
    hi = tl.where(off == 0, k, tl.maximum(tl.load(kmax_ptr + meta, mask=d_ok), k)).to(kmax_ptr.dtype.element_ty)
    lo = tl.where(off == 0, k, tl.minimum(tl.load(kmin_ptr + meta, mask=d_ok), k)).to(kmax_ptr.dtype.element_ty)
    tl.store(kmax_ptr + meta, hi, mask=d_ok)
    tl.store(kmin_ptr + meta, lo, mask=d_ok)
    return hi, lo


def _query_signs(q_ptr, b, kvh, stride_qb, stride_qh, offs_h, offs_d, h_ok, d_ok, dtype: tl.constexpr,
                 GROUP: tl.constexpr):
    """The group's query rows in the bounds' dtype as (max(q, 0), min(q, 0)):
    max(q_c M_c, q_c m_c) = max(q_c, 0) M_c + min(q_c, 0) m_c since M_c >= m_c, two dots."""
    q = tl.load(q_ptr + b * stride_qb + (kvh * GROUP + offs_h)[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(dtype)
    q_pos = tl.where(q > 0, q, tl.zeros_like(q))
    return q_pos, q - q_pos


@lazy_jit
def _page_scores_kernel(
    q_ptr, kmax_ptr, kmin_ptr, page_table_ptr, kv_lens_ptr, scores_ptr, k_ptr, slot_ptr, maxima_ptr,
    stride_qb, stride_qh, stride_mp, stride_mh, stride_pt, stride_kp, stride_ko, stride_kh, P, HKV, N_GROUPS,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, ITERS: tl.constexpr, DOT_PREC: tl.constexpr,
    FOLD_NEW: tl.constexpr, MAX_GROUP: tl.constexpr, SINK_PAGES: tl.constexpr, RECENT: tl.constexpr,
    KEEP: tl.constexpr, LATE: tl.constexpr, PDL: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < GROUP
    d_ok = offs_d < HEAD_DIM
    n = tl.load(kv_lens_ptr + b)
    n_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
    if tl.program_id(1) * (ITERS * BLOCK_P) >= n_pages:
        return  # past the request's pages: nothing to score (a short request in a wide table)
    folds = False
    if FOLD_NEW:  # the step's key into its page's bounds, by the program that reads that page
        slot = tl.load(slot_ptr + b).to(tl.int64)
        folds = (slot >= 0) & ((n_pages - 1) // (BLOCK_P * ITERS) == tl.program_id(1))
        if not LATE:
            if folds:
                _fold_key(k_ptr, kmax_ptr, kmin_ptr, slot, kvh, stride_kp, stride_ko, stride_kh, stride_mp,
                          stride_mh, offs_d, d_ok, PAGE_SIZE)
            tl.debug_barrier()  # the fold's stores before this program's tile loads
    if not LATE:
        q_pos, q_neg = _query_signs(q_ptr, b, kvh, stride_qb, stride_qh, offs_h, offs_d, h_ok, d_ok,
                                    kmax_ptr.dtype.element_ty, GROUP)
    if RECENT > 0:  # the middle pages end before the page of the first recent token
        mid_end = tl.maximum(n - RECENT, 0) // PAGE_SIZE
    else:
        mid_end = n_pages
    first = tl.program_id(1) * ITERS  # this program's first tile
    if KEEP:  # the tiles' scores, a row a tile, stored after the loop
        tile_of = tl.arange(0, ITERS)
        kept = tl.full([ITERS, BLOCK_P], float("-inf"), tl.float32)
    for it in range(ITERS):
        offs_p = (first + it) * BLOCK_P + tl.arange(0, BLOCK_P)
        p_ok = offs_p < n_pages
        page = tl.load(page_table_ptr + b * stride_pt + offs_p, mask=p_ok, other=0).to(tl.int64)
        meta = page[:, None] * stride_mp + kvh * stride_mh + offs_d[None, :]
        m_ok = p_ok[:, None] & d_ok[None, :]
        hi = tl.load(kmax_ptr + meta, mask=m_ok, other=0.0)
        lo = tl.load(kmin_ptr + meta, mask=m_ok, other=0.0)
        if LATE:  # q after the tile's loads (issued before the wait): `_page_scores`' `pdl`
            after = pdl_wait(PDL)  # 0; q's and the key's addresses depend on it: neither load moves above the wait
            q_pos, q_neg = _query_signs(q_ptr + after, b, kvh, stride_qb, stride_qh, offs_h, offs_d, h_ok, d_ok,
                                        kmax_ptr.dtype.element_ty, GROUP)
        upper = tl.dot(q_pos, tl.trans(hi), input_precision=DOT_PREC)
        upper += tl.dot(q_neg, tl.trans(lo), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_P]
        upper = tl.where(h_ok[:, None], upper, float("-inf"))
        best = tl.where(p_ok, tl.max(upper, 0), float("-inf"))
        if LATE and FOLD_NEW:  # the folded page's score from its new bounds (the tile loaded the old ones)
            if folds & ((n_pages - 1) // BLOCK_P == first + it):
                new_hi, new_lo = _fold_key(k_ptr + after, kmax_ptr, kmin_ptr, slot, kvh, stride_kp, stride_ko,
                                           stride_kh, stride_mp, stride_mh, offs_d, d_ok, PAGE_SIZE)
                folded = tl.sum(q_pos.to(tl.float32) * new_hi.to(tl.float32)[None, :]
                                + q_neg.to(tl.float32) * new_lo.to(tl.float32)[None, :], 1)
                folded = tl.max(tl.where(h_ok, folded, float("-inf")), 0)
                best = tl.where(offs_p == n_pages - 1, folded, best)
        if KEEP:  # kept in the dot's layout (a store here would go through shared memory, two barriers)
            kept = tl.where(tile_of[:, None] == it, best[None, :], kept)
        else:
            tl.store(scores_ptr + pid_bh * P + offs_p, best, mask=offs_p < P)
            if MAX_GROUP > 0:  # the middle pages' maxima, MAX_GROUP pages a group (it divides BLOCK_P)
                mid = tl.where((offs_p >= SINK_PAGES) & (offs_p < mid_end), best, float("-inf"))
                gmax = tl.max(tl.reshape(mid, [BLOCK_P // MAX_GROUP, MAX_GROUP]), 1)
                offs_g = (first + it) * (BLOCK_P // MAX_GROUP) + tl.arange(0, BLOCK_P // MAX_GROUP)
                tl.store(maxima_ptr + pid_bh * N_GROUPS + offs_g, gmax, mask=offs_g < N_GROUPS)
    if KEEP:
        at = (first + tile_of[:, None]) * BLOCK_P + tl.arange(0, BLOCK_P)[None, :]
        tl.store(scores_ptr + pid_bh * P + at, kept, mask=at < P)
        if MAX_GROUP > 0:
            n_g: tl.constexpr = BLOCK_P // MAX_GROUP
            mid = tl.where((at >= SINK_PAGES) & (at < mid_end), kept, float("-inf"))
            gmax = tl.max(tl.reshape(mid, [ITERS, n_g, MAX_GROUP]), 2)
            offs_g = (first + tile_of[:, None]) * n_g + tl.arange(0, n_g)[None, :]
            tl.store(maxima_ptr + pid_bh * N_GROUPS + offs_g, gmax, mask=offs_g < N_GROUPS)
