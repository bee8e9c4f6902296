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
it syncs on CUDA), `_triton` one program per (request, block of tokens), every KV head:
no host sync, CUDA-graph capturable.

`h2o_victim_*(scores, positions, table, layers, num_tokens, n, sink_tokens,
recent_tokens)`: the decode eviction's pick, one victim per row. Whole pools `[L,
num_pages, page_size, Hkv]`; G requests' page tables `table [G, P]`, each holding ``n``
tokens in every layer of `layers [nl]` (slots in any token order) and ``num_tokens [G]``
tokens so far. Returns `[G, nl, Hkv]` int64: the cache index of the unprotected token
(position at or past `sink_tokens` and below `num_tokens - recent_tokens`) with the
lowest score, ties to the later position: `methods.h2o.h2o_victims` with count 1, read
straight from the pools (the Triton kernel: one program per (request, layer), all KV
heads, no gathered copies).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._common import cdiv, check_launch, lazy_jit, next_pow2

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
                                 *, block_n: int = 128) -> None:
    page_size, hkv = _check(scores, positions, colsum, page_table)
    if not (scores.is_contiguous() and positions.is_contiguous() and colsum.stride(-1) == 1):
        raise ValueError("scores and positions must be contiguous, colsum contiguous in its last dim")
    check_launch(scores, positions, colsum, page_table, kv_lens, first_new, pos0)
    B, _, M = colsum.shape
    if B == 0 or M == 0:
        return
    _accumulate_kernel[(B, cdiv(M, block_n))](
        scores, positions, colsum, page_table, kv_lens, first_new, pos0,
        colsum.stride(0), colsum.stride(1), page_table.stride(0), M,
        HKV=hkv, BLOCK_H=next_pow2(hkv), PAGE_SIZE=page_size, BLOCK_N=block_n, num_warps=4,
    )


@lazy_jit
def _accumulate_kernel(
    scores_ptr, pos_ptr, colsum_ptr, table_ptr, lens_ptr, first_ptr, pos0_ptr,
    stride_cb, stride_ch, stride_tb, M,
    HKV: tl.constexpr, BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # one program per (request, block of tokens), every KV head: a slot's Hkv entries are
    # adjacent in the pools, so the tile [BLOCK_N, Hkv] reads and writes whole sectors
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    n = tl.load(lens_ptr + b)
    tok = (offs < n) & (offs < M)
    ok = tok[:, None] & (offs_h < HKV)[None, :]
    page = tl.load(table_ptr + b * stride_tb + offs // PAGE_SIZE, mask=tok, other=0)
    at = (page.to(tl.int64) * PAGE_SIZE + offs % PAGE_SIZE)[:, None] * HKV + offs_h[None, :]
    c = tl.load(colsum_ptr + b * stride_cb + offs_h[None, :] * stride_ch + offs[:, None], mask=ok, other=0.0)
    first = tl.load(first_ptr + b)
    new = (offs >= first)[:, None]
    old = tl.load(scores_ptr + at, mask=ok & ~new, other=0.0)
    tl.store(scores_ptr + at, old + c, mask=ok)
    pos = tl.load(pos0_ptr + b).to(tl.int64) + offs - first
    tl.store(pos_ptr + at, tl.broadcast_to(pos.to(tl.int32)[:, None], (BLOCK_N, BLOCK_H)), mask=ok & new)


def h2o_victim_ref(scores, positions, table, layers, num_tokens, n, sink_tokens, recent_tokens):
    page_size, hkv = scores.shape[2], scores.shape[3]
    layers = [int(x) for x in layers]
    out = torch.zeros(table.shape[0], len(layers), hkv, dtype=torch.long)
    for g in range(table.shape[0]):
        T = int(num_tokens[g])
        for li, layer in enumerate(layers):
            for h in range(hkv):
                best = None
                for j in range(n):
                    page, off = int(table[g, j // page_size]), j % page_size
                    p = int(positions[layer, page, off, h])
                    if p < sink_tokens or p >= T - recent_tokens:
                        continue
                    key = (max(float(scores[layer, page, off, h]), 0.0), -p)
                    if best is None or key < best[0]:
                        best = (key, j)
                out[g, li, h] = best[1]
    return out.to(scores.device)


def h2o_victim_triton(scores, positions, table, layers, num_tokens, n, sink_tokens, recent_tokens,
                      *, block_n: int = 128):
    contiguous = scores.is_contiguous() and positions.is_contiguous()
    if scores.dim() != 4 or positions.shape != scores.shape or not contiguous:
        raise ValueError(f"scores and positions must be contiguous [L, num_pages, page_size, Hkv] pools, got "
                         f"{tuple(scores.shape)} and {tuple(positions.shape)}")
    device = check_launch(scores, positions, table, layers, num_tokens)
    G, nl, hkv = table.shape[0], layers.shape[0], scores.shape[3]
    out = torch.empty((G, nl, hkv), dtype=torch.long, device=device)
    if G == 0 or nl == 0:
        return out
    _victim_kernel[(G, nl)](
        scores, positions, table, layers, num_tokens, out, table.stride(0), scores.stride(0), nl, n,
        sink_tokens, recent_tokens,
        HKV=hkv, BLOCK_H=next_pow2(hkv), PAGE_SIZE=scores.shape[2], BLOCK_N=block_n, num_warps=4,
    )
    return out


@lazy_jit
def _victim_kernel(
    scores_ptr, pos_ptr, table_ptr, layers_ptr, tokens_ptr, out_ptr, stride_tb, stride_layer, NL, n,
    sink, recent,
    HKV: tl.constexpr, BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    g = tl.program_id(0)
    li = tl.program_id(1)
    base = tl.load(layers_ptr + li).to(tl.int64) * stride_layer
    last = tl.load(tokens_ptr + g).to(tl.int64) - recent  # positions from here on are recent
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < HKV
    never = 9223372036854775807
    best = tl.full([BLOCK_H], never, tl.int64)
    best_j = tl.zeros([BLOCK_H], tl.int64)
    for start in range(0, n, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        ok = (j < n)[:, None] & h_ok[None, :]
        page = tl.load(table_ptr + g * stride_tb + j // PAGE_SIZE, mask=j < n, other=0).to(tl.int64)
        at = base + (page * PAGE_SIZE + j % PAGE_SIZE)[:, None] * HKV + offs_h[None, :]
        s = tl.load(scores_ptr + at, mask=ok, other=0.0)
        p = tl.load(pos_ptr + at, mask=ok, other=0).to(tl.int64)
        s = tl.where(s > 0.0, s, 0.0)  # scores are >= 0; -0.0 and 0.0 share one key
        key = (s.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (2147483647 - p)
        key = tl.where(ok & (p >= sink) & (p < last), key, never)
        low = tl.min(key, axis=0)  # [BLOCK_H]; keys of unprotected tokens are distinct
        at_low = tl.min(tl.where(key == low[None, :], j[:, None].to(tl.int64), never), axis=0)
        better = low < best
        best = tl.where(better, low, best)
        best_j = tl.where(better, at_low, best_j)
    tl.store(out_ptr + (g * NL + li) * HKV + offs_h, best_j, mask=h_ok)
