"""Decode attention over a per-(request, KV head) selection of the paged cache.

Token variant: `indices [B, Hkv, K]` int32 logical token ids, the first
`num_selected [B, Hkv]` valid. Page variant: `page_indices [B, Hkv, P]` logical page
numbers, the first `num_pages_selected [B, Hkv]` valid; every token of a chosen page that
is below `kv_lens[b]` is attended. Logical token i lives at page `page_table[b, i //
page_size]`, offset `i % page_size`. Out-of-range ids (< 0 or >= kv_lens) are skipped;
duplicates are attended twice (callers pass sets). A row with nothing selected gives a
zero output and lse -inf.

Rows variant: the token variant with each entry already the pool row it names (`page *
page_size + offset`, OmniKV's choice translated once at its filter layer for the layers
after it), so a tile skips the page-table load.

Triton: the split-K kernel of `paged_decode.py`, whose items are the selection entries
(split over K entries, or P * page_size tokens) instead of the token range.
"""
from __future__ import annotations

import torch

from . import _common
from ._common import check_cache
from .paged_decode import MODE_PAGES, MODE_ROWS, MODE_TOKENS, split_k_decode

# The page variant's launch when the rows are too few to fill the GPU alone (Quest's 128K
# shape: 6 x 8 rows), read at each call (profile_decode_step.py --kernel-const sets them for
# A/Bs): tokens a split, and whether the last split of a row merges the row's partials
# (`split_k_decode`'s `fused_combine`; None: its auto choice, a merge launch). H200, Quest
# b=6 at 128K, graph step (session 26, results/quest_page_merge_h200.jsonl): the merge
# launch 8.406 ms, merged in the split kernel 8.890 (chunks of 256: 8.725).
PAGE_CHUNK = 128
PAGE_MERGE_IN_SPLIT: bool | None = None
PAGE_BLOCK_N = 32  # its tiles; and its stages (None: 2 for 128-token splits, else 3)
PAGE_STAGES: int | None = None
# The token variant's launch for rows too few to fill the GPU alone (OmniKV's and DeltaKV's
# sparse layers at 128K: 6 x 8 rows of 2048 chosen tokens), read at each call: splits of
# TOKEN_CHUNK chosen tokens (None: the split planner's chunk, 256 there), tiles of
# TOKEN_BLOCK_N, TOKEN_STAGES stages. H200, OmniKV b=6 at 128K, graph step (session 30,
# results/omnikv_attention_h200.jsonl, two alternating rounds): the planner's chunks with 3
# stages 9.164 / 9.165 ms against 9.333 / 9.328 with its 2 (split kernels 4631 / 4637 us a
# step against 4783 / 4787); fixed 64-, 128- or 256-token chunks in tiles of 32, 2 stages,
# 9.38-9.43 ms. From ~10 requests on the planner cuts each row by its own length; DeltaKV
# b=20 (160 rows) took 35.721 ms with 3 stages against 35.654 with 2 (one profile each).
TOKEN_CHUNK: int | None = None
TOKEN_BLOCK_N = 64
TOKEN_STAGES = 3
# Warps a program of the page, token and rows variants' launches above (None:
# split_k_decode's choice, 4 there). H200, b=6 at 128K, graph step, alternating, two rounds
# (session 44, call s44-4, results/omnikv_filter_launch_s44_h200.jsonl): OmniKV's rows at 2
# warps 8.440 / 8.439 ms against 8.463 / 8.453 (its split kernels 4124 us a step against
# 4157); Quest's pages at 2 warps 8.247 / 8.232 against 8.175 / 8.182. DeltaKV's token ids
# keep 4 (not measured at 2).
PAGE_WARPS: int | None = None
TOKEN_WARPS: int | None = None
ROWS_WARPS: int | None = 2


def _selected_attention_ref(q, k_cache, v_cache, page_table, kv_lens, tokens_of, scale, return_lse):
    B, Hq, d = q.shape
    _, Hkv = check_cache(k_cache, Hq, d)
    g, scale = Hq // Hkv, _common.default_scale(d, scale)
    out = torch.zeros(B, Hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq), float("-inf"), device=q.device)
    for b in range(B):
        for h in range(Hkv):
            tok = tokens_of(b, h).long()
            tok = tok[(tok >= 0) & (tok < int(kv_lens[b]))]
            k = _common.gather_tokens(k_cache, page_table[b], tok)[:, h]
            v = _common.gather_tokens(v_cache, page_table[b], tok)[:, h]
            heads = slice(h * g, (h + 1) * g)
            out[b, heads], lse[b, heads] = _common.attend(q[b, heads], k, v, scale)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def sparse_decode_ref(q, k_cache, v_cache, page_table, kv_lens, indices, num_selected, scale=None,
                      return_lse=False):
    def tokens_of(b, h):
        return indices[b, h, : int(num_selected[b, h])]

    return _selected_attention_ref(q, k_cache, v_cache, page_table, kv_lens, tokens_of, scale, return_lse)


def sparse_decode_triton(q, k_cache, v_cache, page_table, kv_lens, indices, num_selected, scale=None,
                         return_lse=False, *, kv_chunk=None, balanced=None, counters=None, **tuning):
    """`kv_chunk` (tokens a split), `tuning` (`split_k_decode`'s block_n, num_warps,
    num_stages): by default the split planner's launch, and where rows (B x Hkv) are under
    4 programs an SM, `TOKEN_CHUNK` tokens a split (None: the planner's chunks, fixed or
    each row's own), tiles of `TOKEN_BLOCK_N`, `TOKEN_STAGES` stages."""
    return _entries_launch(MODE_TOKENS, q, k_cache, v_cache, page_table, kv_lens, indices, num_selected, scale,
                           return_lse, kv_chunk, balanced, counters, tuning)


def _entries_launch(mode, q, k_cache, v_cache, page_table, kv_lens, sel, num_sel, scale, return_lse, kv_chunk,
                    balanced, counters, tuning):
    """The token and rows variants' launch: one item an entry."""
    _check_selection(q, k_cache, sel, num_sel)
    if kv_chunk is None and balanced is None and q.shape[0] * k_cache.shape[2] < 4 * _common.num_sms(q.device):
        kv_chunk = TOKEN_CHUNK
        tuning.setdefault("block_n", TOKEN_BLOCK_N)
        tuning.setdefault("num_stages", TOKEN_STAGES)
        tuning.setdefault("num_warps", ROWS_WARPS if mode == MODE_ROWS else TOKEN_WARPS)
    return split_k_decode(q, k_cache, v_cache, page_table, kv_lens, mode=mode, capacity=sel.shape[2], sel=sel,
                          num_sel=num_sel, scale=scale, return_lse=return_lse, kv_chunk=kv_chunk, balanced=balanced,
                          counters=counters, **tuning)


def sparse_rows_decode_ref(q, k_cache, v_cache, rows, num_selected, scale=None, return_lse=False):
    """The token variant over pool rows: `rows [B, Hkv, K]` int32 or int64, entry `page *
    page_size + offset` of the cache itself (no page table), the first `num_selected [B,
    Hkv]` valid; a negative entry is skipped."""
    page_size = k_cache.shape[1]
    pool = torch.arange(k_cache.shape[0], device=q.device, dtype=torch.long)[None]  # the identity page table
    B = q.shape[0]

    def tokens_of(b, h):
        r = rows[b, h, : int(num_selected[b, h])].long()
        return r[r >= 0]

    lens = torch.full((B,), k_cache.shape[0] * page_size, device=q.device, dtype=torch.long)
    return _selected_attention_ref(q, k_cache, v_cache, pool.expand(B, -1), lens, tokens_of, scale, return_lse)


def sparse_rows_decode_triton(q, k_cache, v_cache, page_table, kv_lens, rows, num_selected, scale=None,
                              return_lse=False, *, kv_chunk=None, balanced=None, counters=None, **tuning):
    """`sparse_rows_decode_ref` with the token variant's launch (`sparse_decode_triton`'s
    knobs, `TOKEN_*`, at `ROWS_WARPS` warps): each tile loads its rows and then the K and V they name, where the
    token variant first looks each token's page up in the page table (a load in between).
    `page_table`, `kv_lens`: the step's, checked as the token variant's (the rows must
    belong to those requests' pages; the kernel does not read them)."""
    return _entries_launch(MODE_ROWS, q, k_cache, v_cache, page_table, kv_lens, rows, num_selected, scale,
                           return_lse, kv_chunk, balanced, counters, tuning)


def sparse_page_decode_ref(q, k_cache, v_cache, page_table, kv_lens, page_indices, num_pages_selected,
                           scale=None, return_lse=False):
    page_size = k_cache.shape[1]

    def tokens_of(b, h):
        pages = page_indices[b, h, : int(num_pages_selected[b, h])].long()
        pages = pages[pages >= 0]
        offsets = torch.arange(page_size, device=pages.device)
        return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)

    return _selected_attention_ref(q, k_cache, v_cache, page_table, kv_lens, tokens_of, scale, return_lse)


def sparse_page_decode_triton(q, k_cache, v_cache, page_table, kv_lens, page_indices, num_pages_selected,
                              scale=None, return_lse=False, *, kv_chunk=None, **tuning):
    """`kv_chunk` (tokens a split) and `tuning`: `split_k_decode`'s launch knobs (block_n,
    num_warps, num_stages; `bench_gpu --quest-select` sweeps them). By default, when the
    rows (B x Hkv) are too few to fill the GPU alone, splits of 128 tokens in tiles of 32,
    two stages: at Quest's 128K shape (6 x 8 rows of 129 pages) 21.1 us a launch against
    23.0 for the split planner's choice with tiles of 64 in three stages, the previous
    default, and 25.3 in two (results/quest_kernels_h200.jsonl, commits 3b57167 and
    52e1017)."""
    if kv_chunk is None and q.shape[0] * k_cache.shape[2] < 4 * _common.num_sms(q.device):
        kv_chunk = PAGE_CHUNK  # rows too few to fill the GPU alone (else the planner's one program a row)
        tuning.setdefault("block_n", PAGE_BLOCK_N)
        tuning.setdefault("fused_combine", PAGE_MERGE_IN_SPLIT)
        tuning.setdefault("num_warps", PAGE_WARPS)
        if PAGE_STAGES:
            tuning.setdefault("num_stages", PAGE_STAGES)
    tuning.setdefault("num_stages", 2 if kv_chunk == 128 else 3)
    _check_selection(q, k_cache, page_indices, num_pages_selected)
    return split_k_decode(q, k_cache, v_cache, page_table, kv_lens, mode=MODE_PAGES,
                          capacity=page_indices.shape[2] * k_cache.shape[1], sel=page_indices,
                          num_sel=num_pages_selected, scale=scale, return_lse=return_lse, kv_chunk=kv_chunk,
                          **tuning)


def _check_selection(q, k_cache, sel, num_sel):
    B, Hkv = q.shape[0], k_cache.shape[2]
    if sel.dim() != 3 or tuple(sel.shape[:2]) != (B, Hkv) or tuple(num_sel.shape) != (B, Hkv):
        raise ValueError(f"selection must be [B={B}, Hkv={Hkv}, K] with counts [B, Hkv], got "
                         f"{tuple(sel.shape)} and {tuple(num_sel.shape)}")
    if sel.stride(-1) != 1:
        raise ValueError("selection rows must be contiguous")
    if sel.dtype not in (torch.int32, torch.int64) or num_sel.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"selection must be integer, got {sel.dtype} / {num_sel.dtype}")
