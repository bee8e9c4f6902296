"""The Triton kernel behind `paged_decode.split_k_decode`: one program per (request x KV
head row, chunk) of split-K flash decoding over the paged cache, dense or over a
selection (tokens, pages or pool rows: `MODE`), optionally storing logits, merging the
row's partials in its last program (`COMBINE`), or planned flat (`BALANCED`).

`paged_decode` launches it: its wrapper checks shapes, plans the chunks and chooses the
constexprs, and its docstring says how the pieces fit. The kernel keeps its name:
profiles (results/profile_*.json) list kernels by name. `LazyKernel` jits the helpers with
the kernel at the first launch; importing this module needs no Triton.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._common import lazy_jit
from .balanced_plan import balanced_chunk
from .online_softmax import softmax_step
from .split_merge import merge_splits

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


@lazy_jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, kv_lens_ptr, sel_ptr, num_sel_ptr,
    part_out_ptr, part_lse_ptr, logits_ptr, out_ptr, lse_ptr, counter_ptr, meta_ptr, qk_scale,
    stride_qb, stride_qh, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
    stride_pt, stride_sel_b, stride_sel_h, stride_ns_b, stride_ns_h, stride_ob, stride_oh,
    num_splits, fine_splits, min_chunk, logits_len, HKV, HQ, rows,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    STORE_LOGITS: tl.constexpr, DOT_PREC: tl.constexpr, COMBINE: tl.constexpr, BLOCK_S: tl.constexpr,
    STORE_LSE: tl.constexpr, FINE: tl.constexpr, BALANCED: tl.constexpr, BLOCK_R: tl.constexpr,
    SLACK: tl.constexpr, LOGIT_TILES: tl.constexpr,
):
    if BALANCED:  # a flat grid over the batch's chunks (`balanced_plan.py`): one a program, the rest idle
        r, split, first, n_active, chunk, n_items = balanced_chunk(
            kv_lens_ptr, num_sel_ptr, stride_ns_b, stride_ns_h, rows, num_splits, min_chunk, HKV, tl.program_id(0),
            PAGE_SIZE, BLOCK_N, MODE, BLOCK_R, SLACK)
        if split >= 0:
            if split == 0:  # the row's chunks, for the merge kernel
                tl.store(meta_ptr + 2 * r, first)
                tl.store(meta_ptr + 2 * r + 1, n_active)
            _attend_chunk(q_ptr, k_ptr, v_ptr, page_table_ptr, kv_lens_ptr, sel_ptr, part_out_ptr, part_lse_ptr,
                          logits_ptr, out_ptr, lse_ptr, counter_ptr, qk_scale, stride_qb, stride_qh, stride_kp,
                          stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_pt, stride_sel_b,
                          stride_sel_h, stride_ob, stride_oh, logits_len, HKV, HQ,
                          r, split, chunk, n_items, n_active, tl.program_id(0) * GROUP, 1, first * GROUP, GROUP,
                          GROUP, BLOCK_H, HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, MODE, STORE_LOGITS, DOT_PREC,
                          COMBINE, BLOCK_S, STORE_LSE, True, 0)
    else:  # a (row, split) grid
        pid_bh = tl.program_id(0)
        split = tl.program_id(1)
        b = pid_bh // HKV
        kvh = pid_bh % HKV
        if MODE == 0:
            n_items = tl.load(kv_lens_ptr + b)
        elif MODE != 2:  # tokens or pool rows: one item an entry
            n_items = tl.load(num_sel_ptr + b * stride_ns_b + kvh * stride_ns_h)
        else:
            n_items = tl.load(num_sel_ptr + b * stride_ns_b + kvh * stride_ns_h) * PAGE_SIZE
        if CHUNK == 0:  # the row's own chunk: its items over the splits (fewer if min_chunk), whole blocks
            row_splits = num_splits
            if min_chunk > 0:
                row_splits = tl.minimum(num_splits, tl.maximum(n_items // min_chunk, 1))
            chunk = tl.maximum(tl.cdiv(tl.cdiv(n_items, row_splits), BLOCK_N), 1) * BLOCK_N
        elif FINE:  # fixed chunks, or finer ones for a row too short to fill fine_splits of them
            chunk = CHUNK
            if tl.cdiv(n_items, CHUNK) < fine_splits:  # (a finer cut only where it adds chunks)
                chunk = tl.maximum(tl.cdiv(tl.cdiv(n_items, fine_splits), BLOCK_N), 1) * BLOCK_N
            chunk = tl.multiple_of(chunk, BLOCK_N)
        else:
            chunk = CHUNK
        n_active = tl.maximum(tl.cdiv(n_items, chunk), 1)  # splits with items (split 0 always)
        head0 = (b * HQ + kvh * GROUP) * num_splits
        _attend_chunk(q_ptr, k_ptr, v_ptr, page_table_ptr, kv_lens_ptr, sel_ptr, part_out_ptr, part_lse_ptr,
                      logits_ptr, out_ptr, lse_ptr, counter_ptr, qk_scale, stride_qb, stride_qh, stride_kp,
                      stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_pt, stride_sel_b, stride_sel_h,
                      stride_ob, stride_oh, logits_len, HKV, HQ,
                      pid_bh, split, chunk, n_items, n_active, head0 + split, num_splits, head0, 1,
                      GROUP, BLOCK_H, HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, MODE, STORE_LOGITS, DOT_PREC,
                      COMBINE, BLOCK_S, STORE_LSE, False,
                      LOGIT_TILES)


def _attend_chunk(q_ptr, k_ptr, v_ptr, page_table_ptr, kv_lens_ptr, sel_ptr, part_out_ptr, part_lse_ptr, logits_ptr,
                  out_ptr, lse_ptr, counter_ptr, qk_scale, stride_qb, stride_qh, stride_kp, stride_ko, stride_kh,
                  stride_vp, stride_vo, stride_vh, stride_pt, stride_sel_b, stride_sel_h, stride_ob, stride_oh,
                  logits_len, HKV, HQ, pid_bh, split, chunk, n_items, n_active, slot, slot_h, merge_base, merge_step,
                  GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, STORE_LOGITS: tl.constexpr,
                  DOT_PREC: tl.constexpr, COMBINE: tl.constexpr, BLOCK_S: tl.constexpr, STORE_LSE: tl.constexpr,
                  BALANCED: tl.constexpr, LOGIT_TILES: tl.constexpr):
    """Chunk `split` (items [split * chunk, min(n_items, ...))) of row `pid_bh` (request x
    KV head) for the group's query heads: its partial at slots `slot + i * slot_h` (query
    head i of the group), or the output itself where the row has one chunk with items (or
    the launch one split). With COMBINE 1 the last of the row's chunks to finish merges
    the row's partials, at `merge_base + i * slot_h + s * merge_step` for chunk s."""
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    kv_len = tl.load(kv_lens_ptr + b)
    start = split * chunk  # an inactive split reads nothing (and, merging in-kernel, writes nothing)
    end = tl.minimum(start + chunk, n_items)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    hq = kvh * GROUP + offs_h
    q = tl.load(q_ptr + b * stride_qb + hq[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    sel_row = sel_ptr + b * stride_sel_b + kvh * stride_sel_h
    pt_row = page_table_ptr + b * stride_pt

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # STORE_LOGITS 2: the row's own maxima (request x KV head); 3: the request's, shared by its KV heads, each
    # head's max taken in atomically (the caller fills it with -inf first).
    logits_row = logits_ptr + (b if STORE_LOGITS == 3 else pid_bh).to(tl.int64) * logits_len
    if LOGIT_TILES > 0:  # the chunk's group maxima, a row a tile, stored once after the loop
        tile_of = tl.arange(0, LOGIT_TILES)
        tile_max = tl.full([LOGIT_TILES, BLOCK_N], float("-inf"), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        items = n0 + tl.arange(0, BLOCK_N)
        valid = items < end
        if MODE == 3:  # the pool's own token rows (page * PAGE_SIZE + offset): no page-table load
            pool_row = tl.load(sel_row + items, mask=valid, other=-1)
            valid = valid & (pool_row >= 0)
            pool_row = tl.where(valid, pool_row, 0)
            page = (pool_row // PAGE_SIZE).to(tl.int64)
            off = pool_row % PAGE_SIZE
        else:
            if MODE == 0:
                tok = items
            elif MODE == 1:
                tok = tl.load(sel_row + items, mask=valid, other=0)
                valid = valid & (tok >= 0) & (tok < kv_len)
            else:
                lp = tl.load(sel_row + items // PAGE_SIZE, mask=valid, other=0)
                tok = lp * PAGE_SIZE + items % PAGE_SIZE
                valid = valid & (lp >= 0) & (tok < kv_len)
            tok = tl.where(valid, tok, 0)
            page = tl.load(pt_row + tok // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            off = tok % PAGE_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kp + off[:, None] * stride_ko + kvh * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        if STORE_LOGITS == 1:  # every query head's log2-domain logits
            l_ptrs = logits_ptr + (b * HQ + hq)[:, None] * logits_len + items[None, :]
            tl.store(l_ptrs, s, mask=h_mask[:, None] & valid[None, :] & (items < logits_len)[None, :])
        elif STORE_LOGITS >= 2:  # the group's max, back in natural units (3: into the row's max over groups)
            s_max = tl.max(tl.where(h_mask[:, None], s, float("-inf")), 0) * 0.6931471805599453
            if LOGIT_TILES > 0:  # kept in the dot's layout: a store a tile would cross the warps through
                tile_max = tl.where(tile_of[:, None] == (n0 - start) // BLOCK_N, s_max[None, :], tile_max)
            elif STORE_LOGITS == 2:  # shared memory (two barriers a tile)
                tl.store(logits_row + items, s_max, mask=valid & (items < logits_len))
            else:
                tl.atomic_max(logits_row + items, s_max, mask=valid & (items < logits_len), sem="relaxed")
        m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)
        v = tl.load(v_ptr + page[:, None] * stride_vp + off[:, None] * stride_vo + kvh * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if LOGIT_TILES > 0:
        at = start + tile_of[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        if STORE_LOGITS == 2:
            tl.store(logits_row + at, tile_max, mask=(at < end) & (at < logits_len))
        else:
            tl.atomic_max(logits_row + at, tile_max, mask=(at < end) & (at < logits_len), sem="relaxed")
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # log2 domain
    hd_mask = h_mask[:, None] & d_mask[None, :]
    # The only split, or the row's only split with items where the merge kernel skips such
    # rows (balanced) or there is none (merging in this kernel): the partial is the output.
    if (COMBINE == 2) | (((COMBINE == 1) | BALANCED) & (n_active == 1) & (split == 0)):
        tl.store(out_ptr + b * stride_ob + hq[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=hd_mask)
        if STORE_LSE:
            tl.store(lse_ptr + b * HQ + hq, lse * 0.6931471805599453, mask=h_mask)
    else:
        row = slot + offs_h * slot_h
        # A split past the row's items writes no partial: its lse (-inf, for the second
        # kernel) gives it weight 0, and the merge loads partials of weight > 0 only.
        keep = hd_mask & (split < n_active)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=keep)
        tl.store(part_lse_ptr + row, lse, mask=h_mask if COMBINE == 0 else h_mask & (split < n_active))
        if COMBINE == 1 and split < n_active:
            # Every thread's partial stores before the release; the acquire of the last
            # program to arrive then sees all the row's partials.
            tl.debug_barrier()
            counter = counter_ptr + pid_bh
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_active - 1:  # n_active > 1 here
                for i in range(GROUP):
                    merge_splits(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, b * HQ + kvh * GROUP + i,
                                  merge_base + i * slot_h, merge_step, 0, n_active,
                                  stride_ob, stride_oh, HQ, HEAD_DIM, BLOCK_D, BLOCK_S, STORE_LSE)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
