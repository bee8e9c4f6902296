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

This module holds the torch references, the launch wrappers and their host-side mask
packing; the Triton kernels themselves are in `block_sparse_paged_prefill_kernels`.
"""
from __future__ import annotations

import dataclasses

import torch

from sparseengine.engine.step_context import ScoreRows

from . import _common
from ._common import LOG2E, cdiv, check_cache, check_launch, next_pow2
from .block_sparse_paged_prefill_kernels import _masked_window_colsum_kernel, _paged_block_sparse_kernel


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
                                      scale=None, return_lse=False, *, kv_lens_list=None, q_lens=None,
                                      skip_one_row=False):
    """`kv_lens_list`, `q_lens` (host ints, optional): the same as the tensors, sparing a sync.
    `skip_one_row`: requests with a single query row are not computed (their rows of `out`
    and `lse` are left unwritten; as in `paged_prefill_triton`)."""
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
        MIN_ROWS=2 if skip_one_row else 1, DOT_PREC=_common.dot_precision(q.dtype),
        num_warps=8 if tile >= 128 else 4, num_stages=2,
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


def block_sparse_paged_attend(q, k_cache, v_cache, ctx, view, selection, score_rows, block_mask, decode_attend,
                              route_decode_rows=False):
    """The Triton provider's prefill step under a ``BlockMask``: ``(out, colsums)`` as the
    torch provider computes them. Rows block-sparse (``masks[b]`` None: dense causal);
    column sums under the masks; decode rows of a mixed batch that have a selection read
    only it, through ``decode_attend`` (the provider's ``attend``) on a one-row-per-request
    step. ``route_decode_rows``: where every one-row request is dense causal, those
    requests go to ``decode_attend`` alone (the split-K decode, which also gives their
    column sums), and the block-sparse kernel and the column sums' kernel skip them."""
    lens, q_lens = list(view.kv_lens_list), list(ctx.q_lens)
    host = dict(kv_lens_list=lens, q_lens=q_lens)
    one = [b for b, m in enumerate(q_lens) if m == 1]
    route = route_decode_rows and 0 < len(one) < len(q_lens) and all(block_mask.masks[b] is None for b in one)
    res = block_sparse_paged_prefill_triton(q, k_cache, v_cache, view.page_table, view.kv_lens, ctx.cu_q_lens,
                                            block_mask.masks, block_mask.block_size,
                                            return_lse=score_rows is not None, skip_one_row=route, **host)
    out, lse = res if score_rows is not None else (res, None)
    decoded_cs = {}
    if route:
        group = ctx.group(one)  # index tensors, sub-step and cut views made once a step
        asked = score_rows is not None and any(score_rows.rows[b] for b in one)
        sub_rows = ScoreRows(tuple(score_rows.rows[b] for b in one)) if asked else None
        decoded, cs = decode_attend(group.rows_of(q), k_cache, v_cache, group.step, group.view(view),
                                    None if selection is None else selection.take(one, group.reqs), sub_rows)
        group.put_rows(out, decoded)
        decoded_cs = {b: c for b, c in zip(one, cs) if score_rows.rows[b]} if asked else {}
    elif selection is not None:
        n = len(q_lens)
        last = ctx.cu_q_lens[1:].long() - 1
        rows = dataclasses.replace(ctx, q_lens=(1,) * n, is_decode=True,
                                   cu_q_lens=torch.arange(n + 1, dtype=ctx.cu_q_lens.dtype, device=q.device))
        decoded, _ = decode_attend(q[last], k_cache, v_cache, rows, view, selection, None)
        use = torch.tensor([not d and m == 1 for d, m in zip(selection.dense, q_lens)], device=q.device)
        out[last] = torch.where(use[:, None, None], decoded, out[last])
    if score_rows is None:
        return out, None
    colsums = [decoded_cs.get(b) for b in range(len(lens))]
    rest = [b for b in range(len(lens)) if score_rows.rows[b] and not (route and q_lens[b] == 1)]
    if route and rest:  # the column sums' kernel over those requests only (their rows of q and lse)
        g = ctx.group(rest)
        part = _masked_colsums(g.rows_of(q), g.rows_of(lse), k_cache, g.view(view), g.step,
                               [block_mask.masks[b] for b in rest], block_mask.block_size,
                               [score_rows.rows[b] for b in rest])
        for b, c in zip(rest, part):
            colsums[b] = c
    elif rest:
        part = _masked_colsums(q, lse, k_cache, view, ctx, block_mask.masks, block_mask.block_size, score_rows.rows)
        colsums = [p if p is not None else c for p, c in zip(part, colsums)]
    # zeros where a request asked for none
    return out, [c if c is not None else torch.zeros(k_cache.shape[2], n, device=q.device)
                 for c, n in zip(colsums, lens)]


def _masked_colsums(q, lse, k_cache, view, ctx, masks, block_size, rows):
    """Per request of ``ctx`` its ``[Hkv, kv_len]`` column sums over its last ``rows[b]``
    rows under its mask (one launch a window size), or None where ``rows[b]`` is 0."""
    lens = list(view.kv_lens_list)
    got = [None] * len(lens)
    for w in sorted(set(r for r in rows if r)):
        cs = block_sparse_window_colsum_triton(q, k_cache, view.page_table, view.kv_lens, ctx.cu_q_lens, w, masks,
                                               block_size, max_kv_len=max(lens), lse=lse, kv_lens_list=lens,
                                               q_lens=list(ctx.q_lens))
        for b, r in enumerate(rows):
            if r == w:
                got[b] = cs[b, :, :lens[b]]
    return got


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
