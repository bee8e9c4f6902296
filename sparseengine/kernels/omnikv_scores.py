"""OmniKV filter-layer token scores.

`omnikv_scores_*(q [B, Hq, d], k_cache, page_table, kv_lens, mode, max_kv_len, scale,
lse)` -> `[B, max_kv_len]` fp32, -inf past `kv_lens[b]`:
- mode "logits": max over ALL query heads of `q_h . k_{h // g} * scale`;
- mode "probs": max over all query heads of the softmax probability of the token.
"probs" needs each head's log-sum-exp over the whole row: pass the natural-log `lse
[B, Hq]` the filter layer's dense attention already returned
(`paged_decode_triton(..., return_lse=True)`); without it the kernel first runs a pass
that writes per-tile (max, sum) partials, merged by a torch logsumexp.

`omnikv_scores_torch`: the reference's numbers, vectorised over requests (one batched
gather, no per-request loop, no host sync given `max_kv_len`).

Triton: one program per (request, tile of tokens) loops over the KV heads, so every K
element is read once per pass and the max over heads stays in registers.

`decode_max_logits_*`: the filter layer's own decode attention emitting, per KV head, the
max over its query heads of every token's scaled logit (`[B, Hkv, max_kv_len]`); the max
over KV heads of that is the "logits" score, with no second pass over K. The Triton launch
folds the KV heads in itself by default (`FOLD_KV_HEADS`: `[B, 1, max_kv_len]`). Engine path:
`ScoreRows(kind="max_logits")`. `group_max_logits_torch`: the scores alone, vectorised.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _common
from ._common import cdiv, check_cache, check_launch, lazy_jit, next_pow2
from .paged_decode import MODE_DENSE, paged_decode_ref, split_k_decode

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl

MODES = ("logits", "probs")
# The filter layer's launch (`decode_max_logits_triton`), read at each call
# (profile_decode_step.py --kernel-const sets them for A/Bs): tokens a tile, warps (None:
# split_k_decode's choice, 4), pipeline stages. H200, OmniKV b=6 at 128K (session 44, call
# s44-2, results/omnikv_filter_launch_s44_h200.jsonl): tiles of 64 at 4 warps and 2 stages
# (the plain dense layers' launch) ran the filter layers at 820-823 us against 736-738 for
# the dense layers 0 and 1; at 2 warps and 3 stages 747-750 us, graph step 8.498 / 8.499 ms
# against 8.710 / 8.702 (tiles of 128 at 4 warps and 3 stages: 757 us, 8.527 / 8.531).
# DeltaKV b=20 (its full layers cut by their own lengths; s44-6, one profile each): graph
# step median 34.884 ms against 35.458, split kernels 14475 us a step against 15124.
FILTER_BLOCK_N = 64
FILTER_WARPS: int | None = 2
FILTER_STAGES = 3
# Whether `decode_max_logits_triton` folds the KV heads in by default (read at each call; an A/B
# switch): its scores come back `[B, 1, L]`, the max over every query head, each KV head's
# program taking its group's max in with an atomic max into a -inf fill, so the attention writes
# and OmniKV's pick reads 4 bytes a token instead of 4 * Hkv (32 at Llama-3.1-8B's 8 KV heads).
FOLD_KV_HEADS = True


def omnikv_scores_ref(q, k_cache, page_table, kv_lens, mode="logits", max_kv_len=None, scale=None, lse=None):
    """`lse` is accepted for signature parity; the reference computes its own."""
    B, Hq, d = q.shape
    _, Hkv = check_cache(k_cache, Hq, d)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    g, scale = Hq // Hkv, _common.default_scale(d, scale)
    L = int(kv_lens.max()) if max_kv_len is None else max_kv_len
    scores = torch.full((B, L), float("-inf"), device=q.device)
    for b in range(B):
        n = int(kv_lens[b])
        k = _common.gather_tokens(k_cache, page_table[b], torch.arange(n, device=q.device)).float()
        k = k.repeat_interleave(g, dim=1)  # [n, Hq, d]
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if mode == "probs":
            s = torch.softmax(s, dim=-1)
        scores[b, :n] = s.max(0).values[:L]
    return scores


def omnikv_scores_torch(q, k_cache, page_table, kv_lens, mode="logits", max_kv_len=None, scale=None, lse=None):
    """The same scores as `omnikv_scores_ref`, vectorised: one gather of every request's
    first `max_kv_len` tokens `[B, max_kv_len, Hkv, d]`, no loop over requests and, with
    `max_kv_len` given, no host sync (the CPU path of OmniKV's batched decode choice).
    Tokens past `kv_lens[b]` are masked before the softmax, so what their slots hold never
    matters. `lse` is accepted for signature parity."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    s, valid = _gathered_logits(q, k_cache, page_table, kv_lens, max_kv_len, scale)
    if mode == "probs":
        s = torch.softmax(s, dim=-1)
    return s.amax(dim=(1, 2)).masked_fill(~valid, float("-inf"))


def _gathered_logits(q, k_cache, page_table, kv_lens, max_kv_len, scale):
    """-> (scaled logits `[B, Hkv, g, L]` fp32, -inf past `kv_lens`; valid `[B, L]`)."""
    B, Hq, d = q.shape
    page_size, Hkv = check_cache(k_cache, Hq, d)
    g, scale = Hq // Hkv, _common.default_scale(d, scale)
    L = int(kv_lens.max()) if max_kv_len is None else max_kv_len
    pos = torch.arange(L, device=q.device)
    pages = page_table.long()[:, (pos // page_size).clamp(max=page_table.shape[1] - 1)]  # [B, L]
    k = k_cache[pages, pos % page_size].float()  # [B, L, Hkv, d]
    s = torch.einsum("bkgd,blkd->bkgl", q.float().reshape(B, Hkv, g, d), k) * scale
    valid = pos[None, :] < kv_lens.to(pos.device).long()[:, None]  # [B, L]
    return s.masked_fill(~valid[:, None, None, :], float("-inf")), valid


def decode_max_logits_ref(q, k_cache, v_cache, page_table, kv_lens, max_kv_len=None, scale=None):
    """Decode attention that also reports, per KV head, the max over its query heads of
    every token's scaled logit: -> (out `[B, Hq, d]` (`paged_decode_ref`'s), scores
    `[B, Hkv, max_kv_len]` fp32, -inf past `kv_lens[b]`). Plain loops: the definition."""
    B, Hq, d = q.shape
    _, Hkv = check_cache(k_cache, Hq, d)
    g, scale = Hq // Hkv, _common.default_scale(d, scale)
    L = int(kv_lens.max()) if max_kv_len is None else max_kv_len
    scores = torch.full((B, Hkv, L), float("-inf"), device=q.device)
    for b in range(B):
        n = int(kv_lens[b])
        k = _common.gather_tokens(k_cache, page_table[b], torch.arange(n, device=q.device)).float()
        for h in range(Hkv):
            s = (q[b, h * g:(h + 1) * g].float() @ k[:, h].T) * scale  # [g, n]
            scores[b, h, :n] = s.max(0).values[:L]
    return paged_decode_ref(q, k_cache, v_cache, page_table, kv_lens, scale), scores


def group_max_logits_torch(q, k_cache, page_table, kv_lens, max_kv_len=None, scale=None):
    """The scores of `decode_max_logits_ref`, vectorised (no loop, no host sync given
    `max_kv_len`): what the torch provider returns beside its own attention output."""
    return _gathered_logits(q, k_cache, page_table, kv_lens, max_kv_len, scale)[0].amax(dim=2)


def decode_max_logits_triton(q, k_cache, v_cache, page_table, kv_lens, max_kv_len=None, scale=None,
                             *, kv_chunk=None, balanced=None, counters=None, fill=True, fold=None):
    """`decode_max_logits_ref` in one pass: the split-K decode stores each token's group
    max as it computes the logits (4 bytes per token and KV head written, against the
    2 * d * 2 bytes of K+V it reads anyway), so no second read of K scores the tokens.
    Launched in tiles of `FILTER_BLOCK_N` tokens, `FILTER_WARPS` warps, `FILTER_STAGES`
    stages. `fill` False leaves the scores past each row's length unwritten (whatever the
    memory held) and saves the launch that fills them with -inf: for callers that read
    only each row's tokens (OmniKV's pick; the Triton provider).
    `fold` (None: `FOLD_KV_HEADS`): the scores come back `[B, 1, L]`, the max over KV heads of
    the reference's (OmniKV's ``logits`` score), 4 bytes a token; they are always filled
    first (the atomic max starts from -inf), whatever `fill` says."""
    B, Hq, d = q.shape
    page_size, Hkv = check_cache(k_cache, Hq, d)
    device = check_launch(q, k_cache, v_cache, page_table, kv_lens)
    L = int(kv_lens.max()) if max_kv_len is None else max_kv_len
    fold = FOLD_KV_HEADS if fold is None else fold
    shape = (B, 1 if fold else Hkv, max(L, 1))
    if fill or fold:
        scores = torch.full(shape, float("-inf"), device=device)
    else:
        scores = torch.empty(shape, device=device)
    capacity = min(page_table.shape[1] * page_size, max(L, 1))  # L bounds every row: no empty splits
    out = split_k_decode(q, k_cache, v_cache, page_table, kv_lens, mode=MODE_DENSE, capacity=capacity,
                         scale=scale, kv_chunk=kv_chunk, logits=scores, logits_group_max=True,
                         logits_all_heads=fold,
                         balanced=balanced, counters=counters, block_n=FILTER_BLOCK_N,
                         num_warps=FILTER_WARPS, num_stages=FILTER_STAGES)
    return out, scores[..., :L]


def omnikv_scores_triton(q, k_cache, page_table, kv_lens, mode="logits", max_kv_len=None, scale=None,
                         lse=None):
    B, Hq, d = q.shape
    page_size, Hkv = check_cache(k_cache, Hq, d)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    device = check_launch(q, k_cache, page_table, kv_lens)
    _common.check_dtypes(q, k_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    g = Hq // Hkv
    L = int(kv_lens.max()) if max_kv_len is None else max_kv_len
    block_n = 64
    n_tiles = cdiv(max(L, 1), block_n)
    scores = _common.empty((B, L), torch.float32, device)
    part_m = part_l = scores
    if mode == "probs" and lse is None:
        part_m = _common.empty((B, Hq, n_tiles), torch.float32, device)
        part_l = _common.empty((B, Hq, n_tiles), torch.float32, device)
    def launch(phase, lse_t):
        _omnikv_kernel[(B, n_tiles)](
            q, k_cache, page_table, kv_lens, lse_t, scores, part_m, part_l,
            _common.default_scale(d, scale), q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0), L, n_tiles, Hkv, Hq,
            GROUP=g, BLOCK_H=max(16, next_pow2(g)), HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)),
            PAGE_SIZE=page_size, BLOCK_N=block_n, PHASE=phase, DOT_PREC=_common.dot_precision(q.dtype),
            num_warps=4,
        )

    if mode == "logits":
        launch(0, scores)
        return scores
    if lse is None:
        launch(1, scores)
        lse = torch.logsumexp(part_m + torch.log(part_l), dim=-1)
    launch(2, lse.float().contiguous())
    return scores


@lazy_jit
def _omnikv_kernel(
    q_ptr, k_ptr, page_table_ptr, kv_lens_ptr, lse_ptr, scores_ptr, part_m_ptr, part_l_ptr, scale,
    stride_qb, stride_qh, stride_kp, stride_ko, stride_kh, stride_pt, L, n_tiles, HKV, HQ,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PHASE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # PHASE 0: max logits; 1: per-tile softmax partials (max, sum); 2: max probs given lse.
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kv_len = tl.load(kv_lens_ptr + b)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_len
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    page = tl.load(page_table_ptr + b * stride_pt + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    k_row = page[:, None] * stride_kp + (offs_n % PAGE_SIZE)[:, None] * stride_ko + offs_d[None, :]
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for kvh in range(0, HKV):
        hq = kvh * GROUP + offs_h
        q = tl.load(q_ptr + b * stride_qb + hq[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        k = tl.load(k_ptr + k_row + kvh * stride_kh, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale
        ok = h_ok[:, None] & n_ok[None, :]
        s = tl.where(ok, s, float("-inf"))
        if PHASE == 0:
            best = tl.maximum(best, tl.max(s, 0))
        elif PHASE == 1:
            m = tl.max(s, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            l_sum = tl.sum(tl.exp(s - m_safe[:, None]), 1)
            part = (b * HQ + hq) * n_tiles + tile
            tl.store(part_m_ptr + part, m, mask=h_ok)
            tl.store(part_l_ptr + part, l_sum, mask=h_ok)
        else:
            lse = tl.load(lse_ptr + b * HQ + hq, mask=h_ok, other=0.0)
            p = tl.where(ok, tl.exp(s - lse[:, None]), float("-inf"))
            best = tl.maximum(best, tl.max(p, 0))
    if PHASE != 1:
        tl.store(scores_ptr + b * L + offs_n, tl.where(n_ok, best, float("-inf")), mask=offs_n < L)
