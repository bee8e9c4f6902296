"""Block-sparse causal prefill over the paged KV cache (flashprefill_v2 in the engine).

Packed rows of B requests over the paged cache, exactly `step_context.BlockMask`: request
b's q_len rows sit at cache indices `kv_len - q_len .. kv_len - 1`, `masks[b]` is `[Hq,
n_q, n_k]` from its first query block `(kv_len - q_len) // block_size` (None: dense causal,
e.g. decode rows). `block_sparse_window_colsum_*`: SnapKV/H2O column sums of the last rows
under the same masks. `block_sparse_paged_attend`: the Triton provider's prefill step with
a block mask.

Triton: the host first turns each mask row into the ascending list of its kept
off-diagonal key blocks (one sort on the device, no sync); one program per (query head,
query tile, request) walks only that list, unmasked (every key of an off-diagonal block is
causal and cached), then the diagonal block with the causal rule, so a skipped block costs
nothing. Heads are the fastest grid axis so the g heads of a KV group read the same K/V
tiles together (L2), late (long) tiles start first. Tiles are min(block_size, 128) square:
block_size must be a power of two >= 16, and the page size and block size must divide one
another (a key tile lies inside one page or covers whole pages; page_size >= tile: one
page-table read per tile).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from . import _common
from ._common import LOG2E, cdiv, check_cache, check_launch, lazy_jit, next_pow2

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


def block_sparse_paged_prefill_ref(q, k_cache, v_cache, page_table, kv_lens, cu_q_lens, masks, block_size=128,
                                   scale=None, return_lse=False):
    """q `[T, Hq, d]` packed rows -> out `[T, Hq, d]` (and lse `[T, Hq]` fp32, natural log):
    each request's rows read the tokens `BlockMask(block_size, masks).token_mask` allows."""
    T, Hq, d = q.shape
    lens, cu = [int(n) for n in kv_lens.tolist()], [int(c) for c in cu_q_lens.tolist()]
    _, Hkv = _check_paged(q, k_cache, lens, cu, masks, block_size)
    g, scale = Hq // Hkv, _common.default_scale(d, scale)
    out = torch.zeros(T, Hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((T, Hq), float("-inf"), device=q.device)
    for b, n in enumerate(lens):
        start, m = cu[b], cu[b + 1] - cu[b]
        if m == 0:
            continue
        tokens = torch.arange(n, device=q.device)
        k = _common.gather_tokens(k_cache, page_table[b], tokens).float()
        v = _common.gather_tokens(v_cache, page_table[b], tokens).float()
        allowed = _allowed(masks[b], block_size, Hq, m, n, q.device)
        for h in range(Hkv):
            heads = slice(h * g, (h + 1) * g)
            s = torch.einsum("mgd,nd->gmn", q[start:start + m, heads].float(), k[:, h]) * scale
            s = s.masked_fill(~allowed[heads], float("-inf"))
            lse[start:start + m, heads] = torch.logsumexp(s, dim=-1).T
            out[start:start + m, heads] = torch.einsum("gmn,nd->mgd", torch.softmax(s, dim=-1), v[:, h])
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def block_sparse_paged_prefill_triton(q, k_cache, v_cache, page_table, kv_lens, cu_q_lens, masks, block_size=128,
                                      scale=None, return_lse=False, *, kv_lens_list=None, q_lens=None):
    """`kv_lens_list`, `q_lens` (host ints, optional): the same as the tensors, sparing a sync."""
    T, Hq, d = q.shape
    device = check_launch(q, k_cache, v_cache, page_table, kv_lens, cu_q_lens)
    _common.check_dtypes(q, k_cache, v_cache)
    lens, cu = _host_lens(kv_lens, cu_q_lens, kv_lens_list, q_lens)
    page_size, Hkv = _check_paged(q, k_cache, lens, cu, masks, block_size)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = _common.empty((T, Hq, d), q.dtype, device)
    lse = _common.empty((T, Hq), torch.float32, device) if return_lse else out
    q_lens_ = [cu[b + 1] - cu[b] for b in range(len(lens))]
    tile = min(block_size, 128)
    n_tiles = max([(n - 1) // tile - (n - m) // tile + 1 for n, m in zip(lens, q_lens_) if m > 0] or [0])
    if n_tiles == 0:
        return (out, lse) if return_lse else out
    lists, counts, list_off, count_off = _kept_block_lists(masks, lens, q_lens_, block_size, device)
    _paged_block_sparse_kernel[(Hq, n_tiles, len(lens))](
        q, k_cache, v_cache, out, lse, page_table, kv_lens, cu_q_lens, lists, counts, list_off, count_off,
        _common.default_scale(d, scale) * LOG2E, n_tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0), Hq,
        GROUP=Hq // Hkv, BLOCK_SIZE=block_size, BLOCK_M=tile, BLOCK_N=tile, SUB=block_size // tile,
        HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), PAGE_SIZE=page_size, STORE_LSE=return_lse,
        DOT_PREC=_common.dot_precision(q.dtype), num_warps=8 if tile >= 128 else 4, num_stages=2,
    )
    return (out, lse) if return_lse else out


def block_sparse_window_colsum_ref(q, k_cache, page_table, kv_lens, cu_q_lens, window, masks, block_size=128,
                                   max_kv_len=None, scale=None, lse=None):
    """-> scores `[B, Hkv, max_kv_len]` fp32: per request, the attention probabilities (under
    its block mask) of its last min(window, q_len) rows, summed over the rows and averaged
    over the g query heads of each KV head; 0 past kv_len. `lse` is accepted for parity."""
    T, Hq, d = q.shape
    lens, cu = [int(n) for n in kv_lens.tolist()], [int(c) for c in cu_q_lens.tolist()]
    _, Hkv = _check_paged(q, k_cache, lens, cu, masks, block_size)
    g, scale = Hq // Hkv, _common.default_scale(d, scale)
    L = max(lens) if max_kv_len is None else max_kv_len
    scores = torch.zeros(len(lens), Hkv, L, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        start, m = cu[b], cu[b + 1] - cu[b]
        w = min(window, m)
        if w == 0:
            continue
        tokens = torch.arange(n, device=q.device)
        k = _common.gather_tokens(k_cache, page_table[b], tokens).float()
        allowed = _allowed(masks[b], block_size, Hq, m, n, q.device)
        for h in range(Hkv):
            heads = slice(h * g, (h + 1) * g)
            s = torch.einsum("wgd,nd->gwn", q[start + m - w:start + m, heads].float(), k[:, h]) * scale
            p = torch.softmax(s.masked_fill(~allowed[heads, m - w:], float("-inf")), dim=-1)
            scores[b, h, :n] = (p.sum(dim=(0, 1)) / g)[:L]
    return scores


def block_sparse_window_colsum_triton(q, k_cache, page_table, kv_lens, cu_q_lens, window, masks, block_size=128,
                                      max_kv_len=None, scale=None, lse=None, *, kv_lens_list=None, q_lens=None):
    """`lse [T, Hq]`: the rows' lse under the masks (from `block_sparse_paged_prefill_triton(...,
    return_lse=True)`); computed here when not given."""
    T, Hq, d = q.shape
    device = check_launch(q, k_cache, page_table, kv_lens, cu_q_lens)
    _common.check_dtypes(q, k_cache)
    lens, cu = _host_lens(kv_lens, cu_q_lens, kv_lens_list, q_lens)
    page_size, Hkv = _check_paged(q, k_cache, lens, cu, masks, block_size)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if lse is None:  # the rows' lse needs no V: K stands in for it
        _, lse = block_sparse_paged_prefill_triton(q, k_cache, k_cache, page_table, kv_lens, cu_q_lens, masks,
                                                   block_size, scale, True, kv_lens_list=lens,
                                                   q_lens=[cu[b + 1] - cu[b] for b in range(len(lens))])
    lse = lse.float().contiguous()
    L = max(lens) if max_kv_len is None else max_kv_len
    scores = _common.empty((len(lens), Hkv, L), torch.float32, device)
    flat, offsets = _packed_masks(masks, device)
    g = Hq // Hkv
    g_pad, w_pad = next_pow2(g), next_pow2(window)
    _masked_window_colsum_kernel[(len(lens), Hkv, cdiv(max(L, 1), 64))](
        q, k_cache, page_table, kv_lens, cu_q_lens, flat, offsets, lse, scores,
        _common.default_scale(d, scale) * LOG2E, L,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0), Hq,
        GROUP=g, G_PAD=g_pad, WINDOW=window, W_ROWS=w_pad * g_pad, BLOCK_R=max(16, min(64, w_pad * g_pad)),
        BLOCK_SIZE=block_size, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), PAGE_SIZE=page_size, BLOCK_N=64,
        DOT_PREC=_common.dot_precision(q.dtype), num_warps=4,
    )
    return scores


def block_sparse_paged_attend(q, k_cache, v_cache, ctx, view, selection, score_rows, block_mask, decode_attend):
    """The Triton provider's prefill step under a ``BlockMask``: ``(out, colsums)`` as the
    torch provider computes them. Rows block-sparse (``masks[b]`` None: dense causal);
    column sums under the masks; decode rows of a mixed batch that have a selection read
    only it, through ``decode_attend`` (the provider's ``attend``) on a one-row-per-request
    step."""
    lens, q_lens = list(view.kv_lens_list), list(ctx.q_lens)
    host = dict(kv_lens_list=lens, q_lens=q_lens)
    res = block_sparse_paged_prefill_triton(q, k_cache, v_cache, view.page_table, view.kv_lens, ctx.cu_q_lens,
                                            block_mask.masks, block_mask.block_size,
                                            return_lse=score_rows is not None, **host)
    out, lse = res if score_rows is not None else (res, None)
    if selection is not None:
        n = len(q_lens)
        last = ctx.cu_q_lens[1:].long() - 1
        rows = dataclasses.replace(ctx, q_lens=(1,) * n, is_decode=True,
                                   cu_q_lens=torch.arange(n + 1, dtype=ctx.cu_q_lens.dtype, device=q.device))
        decoded, _ = decode_attend(q[last], k_cache, v_cache, rows, view, selection, None)
        use = torch.tensor([not d and m == 1 for d, m in zip(selection.dense, q_lens)], device=q.device)
        out[last] = torch.where(use[:, None, None], decoded, out[last])
    colsums = None
    if score_rows is not None:
        by_window = {w: block_sparse_window_colsum_triton(q, k_cache, view.page_table, view.kv_lens, ctx.cu_q_lens,
                                                          w, block_mask.masks, block_mask.block_size,
                                                          max_kv_len=max(lens), lse=lse, **host)
                     for w in sorted(set(score_rows.rows)) if w > 0}
        hkv = k_cache.shape[2]
        colsums = [by_window[w][b, :, :n] if w > 0 else torch.zeros(hkv, n, device=q.device)
                   for b, (w, n) in enumerate(zip(score_rows.rows, lens))]
    return out, colsums


def _allowed(mask, block_size, hq, q_len, kv_len, device):
    """`[Hq, q_len, kv_len]` bool: the keys each row reads (the reference's one source)."""
    from sparseengine.engine.step_context import BlockMask

    allowed = BlockMask(block_size, (mask,)).token_mask(0, q_len, kv_len)
    if allowed is None:
        rows = torch.arange(kv_len - q_len, kv_len, device=device)
        allowed = (torch.arange(kv_len, device=device)[None, :] <= rows[:, None])[None].expand(hq, q_len, kv_len)
    return allowed


def _host_lens(kv_lens, cu_q_lens, kv_lens_list, q_lens):
    """-> (kv_lens, cumulative q_lens) as host ints (one sync unless the caller knows them)."""
    lens = [int(n) for n in (kv_lens.tolist() if kv_lens_list is None else kv_lens_list)]
    if q_lens is None:
        return lens, [int(c) for c in cu_q_lens.tolist()]
    cu = [0]
    for m in q_lens:
        cu.append(cu[-1] + int(m))
    return lens, cu


def _check_paged(q, k_cache, lens, cu, masks, block_size):
    """Validate the block size against the pages and every mask's shape -> (page_size, Hkv)."""
    T, Hq, d = q.shape
    page_size, Hkv = check_cache(k_cache, Hq, d)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if block_size % page_size and page_size % block_size:
        raise ValueError(f"block_size={block_size} and page_size={page_size}: one must be a multiple of the "
                         "other (a key tile must lie inside one page or cover whole pages)")
    if len(masks) != len(lens) or len(cu) != len(lens) + 1 or cu[-1] != T:
        raise ValueError(f"{len(masks)} masks, {len(lens)} kv_lens and {len(cu) - 1} requests in cu_q_lens "
                         f"(covering {cu[-1]} of {T} rows) must agree")
    for b, (m, n) in enumerate(zip(masks, lens)):
        q_len = cu[b + 1] - cu[b]
        if q_len > n:
            raise ValueError(f"request {b}: {q_len} query rows but only {n} cached tokens")
        if m is None or q_len == 0:
            continue
        first = (n - q_len) // block_size
        want = (Hq, (n - 1) // block_size - first + 1, cdiv(n, block_size))
        if tuple(m.shape) != want:
            raise ValueError(f"masks[{b}] must be {list(want)} for q_len={q_len}, kv_len={n}, "
                             f"block_size={block_size}; got {list(m.shape)}")
    return page_size, Hkv


def _kept_block_lists(masks, lens, q_lens, block_size, device):
    """The kept off-diagonal key blocks of every mask row, ascending, packed for the kernel.
    Row (h, i) of request b: `lists[list_off[b] + (h * n_q + i) * n_k:]`, its first
    `counts[count_off[b] + h * n_q + i]` entries; `list_off[b]` -1: dense causal."""
    lists, counts, list_off, count_off = [], [], [], []
    list_size = count_size = 0
    for m, n, q_len in zip(masks, lens, q_lens):
        if m is None or q_len == 0:
            list_off.append(-1)
            count_off.append(0)
            continue
        hq, nq, nk = m.shape
        kb = torch.arange(nk, dtype=torch.int32, device=device)
        qb = (n - q_len) // block_size + torch.arange(nq, device=device)
        kept = m.to(device=device, dtype=torch.bool) & (kb[None, :] < qb[:, None])[None]
        counts.append(kept.sum(-1, dtype=torch.int32).flatten())
        lists.append(torch.where(kept, kb, nk).sort(dim=-1).values.flatten())
        list_off.append(list_size)
        count_off.append(count_size)
        list_size += hq * nq * nk
        count_size += hq * nq
    pad = torch.zeros(1, dtype=torch.int32, device=device)  # never empty: dense rows read entry 0
    as_offsets = dict(dtype=torch.int64, device=device)
    return (torch.cat(lists + [pad]), torch.cat(counts + [pad]), torch.tensor(list_off, **as_offsets),
            torch.tensor(count_off, **as_offsets))


def _packed_masks(masks, device):
    """All masks flattened into one int8 buffer -> (buffer, offsets [B] int64, -1: dense)."""
    flat, offsets, size = [], [], 0
    for m in masks:
        if m is None:
            offsets.append(-1)
            continue
        flat.append(m.to(device=device, dtype=torch.int8).flatten())
        offsets.append(size)
        size += m.numel()
    flat.append(torch.ones(1, dtype=torch.int8, device=device))
    return torch.cat(flat), torch.tensor(offsets, dtype=torch.int64, device=device)


@lazy_jit
def _paged_block_sparse_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, page_table_ptr, kv_lens_ptr, cu_q_ptr,
    lists_ptr, counts_ptr, list_off_ptr, count_off_ptr, qk_scale, n_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_pt, HQ,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SUB: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    STORE_LSE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    first = kv_len - q_len  # cache index of the request's first row
    t0 = (first // BLOCK_M + n_tiles - 1 - tl.program_id(1)) * BLOCK_M  # late tiles (more keys) first
    if (q_len > 0) & (t0 < kv_len):
        kvh = h // GROUP
        offs_m = t0 + tl.arange(0, BLOCK_M)  # cache indices of the tile's rows
        row_ok = (offs_m >= first) & (offs_m < kv_len)
        rows = (q_start + offs_m - first).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = page_table_ptr + b * stride_pt
        qb = t0 // BLOCK_SIZE
        first_qb = first // BLOCK_SIZE
        # this (head, query block)'s list of kept key blocks before the diagonal
        list_off = tl.load(list_off_ptr + b)
        dense = list_off < 0
        row = h * ((kv_len - 1) // BLOCK_SIZE - first_qb + 1) + qb - first_qb
        count = tl.load(counts_ptr + tl.where(dense, 0, tl.load(count_off_ptr + b) + row))
        kept = lists_ptr + tl.where(dense, 0, list_off + row * ((kv_len + BLOCK_SIZE - 1) // BLOCK_SIZE))
        for t in range(0, tl.where(dense, qb, count) * SUB):
            kb = tl.where(dense, t // SUB, tl.load(kept + tl.where(dense, 0, t // SUB)))
            key0 = kb * BLOCK_SIZE + (t % SUB) * BLOCK_N
            keys = key0 + tl.arange(0, BLOCK_N)
            if PAGE_SIZE >= BLOCK_N:  # the tile lies inside one page
                tile_page = tl.load(table + key0 // PAGE_SIZE).to(tl.int64)
                k_rows = tile_page * stride_kp + (keys % PAGE_SIZE)[:, None] * stride_ko
                v_rows = tile_page * stride_vp + (keys % PAGE_SIZE)[:, None] * stride_vo
            else:
                key_pages = tl.load(table + keys // PAGE_SIZE).to(tl.int64)
                k_rows = key_pages[:, None] * stride_kp + (keys % PAGE_SIZE)[:, None] * stride_ko
                v_rows = key_pages[:, None] * stride_vp + (keys % PAGE_SIZE)[:, None] * stride_vo
            kt = tl.load(k_ptr + k_rows + kvh * stride_kh + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            st = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale  # all causal, all cached
            mt = tl.maximum(m_i, tl.max(st, 1))
            alpha_t = tl.exp2(m_i - mt)
            pt = tl.exp2(st - mt[:, None])
            l_i = l_i * alpha_t + tl.sum(pt, 1)
            vt = tl.load(v_ptr + v_rows + kvh * stride_vh + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            acc = acc * alpha_t[:, None] + tl.dot(pt.to(vt.dtype), vt, input_precision=DOT_PREC)
            m_i = mt
        # the diagonal block, always computed, causal inside (up to the tile's last row)
        for n0 in range(qb * BLOCK_SIZE, tl.minimum(kv_len, t0 + BLOCK_M), BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_len
            page = tl.load(table + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            off = offs_n % PAGE_SIZE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + page[:, None] * stride_kp + off[:, None] * stride_ko + kvh * stride_kh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            s = tl.where(n_ok[None, :] & (offs_n[None, :] <= offs_m[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + page[:, None] * stride_vp + off[:, None] * stride_vo + kvh * stride_vh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if STORE_LSE:
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")) * 0.6931471805599453
            tl.store(lse_ptr + rows * HQ + h, lse, mask=row_ok)


@lazy_jit
def _masked_window_colsum_kernel(
    q_ptr, k_ptr, page_table_ptr, kv_lens_ptr, cu_q_ptr, masks_ptr, mask_off_ptr, lse_ptr, scores_ptr,
    qk_scale, L, stride_qt, stride_qh, stride_kp, stride_ko, stride_kh, stride_pt, HQ,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, WINDOW: tl.constexpr, W_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    HKV = tl.num_programs(1)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    first = kv_len - q_len
    first_qb = first // BLOCK_SIZE
    n_q = (kv_len - 1) // BLOCK_SIZE - first_qb + 1
    n_k = (kv_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    mask_off = tl.load(mask_off_ptr + b)
    w_eff = tl.minimum(q_len, WINDOW)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_len
    kb = offs_n // BLOCK_SIZE
    page = tl.load(page_table_ptr + b * stride_pt + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    k = tl.load(k_ptr + page[:, None] * stride_kp + (offs_n % PAGE_SIZE)[:, None] * stride_ko
                + kvh * stride_kh + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    col = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, W_ROWS, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        w = offs_r // G_PAD
        hh = offs_r % G_PAD
        row_ok = (w < w_eff) & (hh < GROUP)
        i = q_len - w_eff + w
        pos = first + i
        hq = kvh * GROUP + hh
        t = q_start + i
        q = tl.load(q_ptr + t[:, None] * stride_qt + hq[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(lse_ptr + t * HQ + hq, mask=row_ok, other=0.0) * 1.4426950408889634
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        ok = row_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        qb = pos // BLOCK_SIZE
        # off-diagonal keys of a masked request: read the mask (dense requests and the diagonal: kept)
        look = ok & (kb[None, :] < qb[:, None]) & (mask_off >= 0)
        row_base = (hq * n_q + qb - first_qb).to(tl.int64) * n_k
        keep = tl.load(masks_ptr + tl.maximum(mask_off, 0) + row_base[:, None] + kb[None, :], mask=look, other=1)
        col += tl.sum(tl.where(ok & (keep != 0), tl.exp2(s - lse[:, None]), 0.0), 0)
    tl.store(scores_ptr + (b * HKV + kvh) * L + offs_n, col / GROUP, mask=offs_n < L)
