"""Quest page selection on the GPU: one program per (request, KV head), no sort.

`quest_select_pages_triton(scores, kv_lens, page_size, sink_tokens, recent_tokens, budget)`
has the contract of `sparseengine.methods.quest.select_pages_batched` (the torch
reference and fallback): `scores [B, Hkv, P]` page bounds (any float dtype; entries past
request b's `ceil(kv_lens[b] / page_size)` pages are never read) -> `(pages [B, Hkv, K]`
int64 logical pages ascending, -1 past the count; `counts [B, Hkv]` int32), `K =
min(selection_width(...), P)`. Forced pages: the sink pages `[0, ceil(sink / page_size))`
and the pages from `recent_first = (n - recent) // page_size` on (none when recent is 0),
or every page of a request within `sink + budget + recent` tokens or whose sink and recent
pages meet. Among the other ("middle") pages it takes the top `min(top, recent_first -
sink_pages)` by score, `top = max(3, budget // page_size)`; ties go to the earlier page
(METHODS.md, `quest_select_pages`), which `torch.topk` does not promise.

How: a score's fp32 bits map to an int32 key with the same order (negative floats flip
their low 31 bits; -0.0 counts as +0.0).

Shortlist first (the default): the middle pages are cut into groups of `group` pages
(`next_pow2(P / 512)`, at least 2, smaller where that leaves about one group a page to take:
`shortlist_groups`); a lower bound L of the m-th largest of the groups'
maxima (its top `L_BITS` bits) is found in registers. At least m middle keys are >= L, so
every key the choice takes (ties included) is >= L: one pass over the row writes those
candidates, in page order, to a per-row scratch of `cap` slots, and the same search (all
32 bits), then the tie rule, runs on them in registers. Two passes over the row in all,
against 2 + 32 / radix_bits. There are at most `group * m` candidates, usually few more
than m (random scores, m = 92 of 8192 pages in groups of 32: about 110 expected); a row
with more than `cap` (many equal scores) runs the full search below.

The groups' maxima may come with the scores (`group_maxima`: the page scores' launch takes
them over the middle pages, `quest.quest_page_scores_and_maxima_triton`): the shortlist then
starts from them instead of its grouped load of the row (Quest's decode step: ~0.5 us a
launch, `MAXIMA_FROM_SCORES`).

Full search: a radix search over the 32 key bits, `radix_bits`
at a time, finds the m-th largest key t: each pass counts the middle keys `>= lo + j *
step` for every digit j at once (one block reduction of 2^radix_bits counts) and keeps the
largest j with at least m. Then one pass counts the keys `> t`, and the last pass takes
those plus the earliest keys equal to t until m are taken, writing each chosen page at its
rank among the chosen ones (an exclusive `tl.cumsum`, carried across blocks), so the output
is ascending with no sort. Sink and recent slots are written by arithmetic. Rows are read
in blocks of `block_p` pages, once per pass over the middle range (the row stays in L2).
Measured on the H200 at the 128K benchmark's shape (B=6, Hkv=8, 8320 pages, in a CUDA
graph; `bench_gpu --quest-select`, commit 5af64cf): the full search (radix 2, blocks of
8192 pages) 54 us per launch; the shortlist (groups of 32, room 512) 24 us at radix 4,
27 us at 2, 33 us at 1. Blocks of 4096 pages (8 warps) are the default since commit
52e1017: 20.6 us at radix 4 against 24.1 with 8192 (16 warps), 21.5 with 8192 and 8 warps,
26.7 with 8192 and 4 warps (results/quest_kernels_h200.jsonl). A variant that held the row's keys in registers through
the full search (one 16384-page block, commit e8e8c56, since removed) ran slower: radix 1 98
us, 2 144 us, 4 770 us. Fixed shapes, no host sync: CUDA-graph capturable. `kv_lens` past P pages is an
invalid input; the kernel then stays in bounds, its choice unspecified.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._common import cdiv, check_launch, check_lens, check_scores, int_arg, lazy_jit, next_pow2

MAX_GROUPS = 512  # shortlist: the page groups a row is cut into at most (group = next_pow2(P / this)) ...
# ... unless that leaves fewer than SHRINK_BELOW groups a page to take: then groups small
# enough for GROUPS_PER_PICK a page, down to MAX_BLOCK_G groups a row. With about as many
# groups as pages to take, L is near the minimum and nearly every middle page a candidate, so
# the shortlist falls back (Quest at total 8192 on a 128K table: 260 groups of 32 for 476
# pages); where even MAX_BLOCK_G groups are fewer than the pages to take, the full search
# runs alone. H200, Quest b=6 at 128K (session 23, results/quest_groups_h200.jsonl): total 8192
# 12.57 -> 10.45 ms a step (selection 3100 -> 990 us); total 4096 (260 groups for 220 pages)
# 9.02 ms with groups of 32 against 9.18 with 16, hence the shrink only below 1.1.
# GROUPS_PER_PICK 0: the group from P alone (before session 23).
SHRINK_BELOW = 1.1
GROUPS_PER_PICK = 2
MAX_BLOCK_G = 1024  # ptxas, sm_90, 8 warps: 2048 group maxima spill ~0.8 KB in L's search; 1024 none
# Shortlist: the key bits of L (the m-th largest group maximum) its search settles, a multiple
# of 4. H200, 128K shape, us a launch (results/quest_select_stages_h200.jsonl, 4eabe02): 32
# bits 20.3-20.5; 16 bits 17.5; 12 bits 16.7; the maxima read back as a plain vector, 32
# bits 18.7, 16 bits 16.8, 12 bits 16.4. In the engine (7304d35, Quest b=6 at 128K) the
# selection took 472 us a step against 524 at 32 bits and 612 before both (session 21's
# profile). 16 keeps L within 2^-7 of the exact bound, so clustered scores add few
# candidates (more than the room: the full search, still exact).
L_BITS = 16

# The launch's pages a block and warps (None: one warp per 512 pages of the block), read at each
# call (profile_decode_step.py --kernel-const sets them for A/Bs). H200, the engine's launch with the
# group maxima given (session 25, results/quest_select_warps_h200.jsonl): blocks of 2048 / 4096 /
# 8192 pages at 8 warps 15.5 / 14.8 / 14.7 us a launch, at 16 warps 18.1 / 17.4 / 17.7, at 4 warps
# 17.5 / 20.2 / 20.4; Quest b=6 graph step 8.387 ms with 16 warps against 8.314 with 8.
BLOCK_P = 4096
NUM_WARPS: int | None = None
# Whether Quest's decode step takes the shortlist's group maxima from the page scores' launch
# (`maxima_group`; the method reads it at each call, so profile_decode_step.py --kernel-const
# can A/B it). H200, Quest b=6 at 128K, graph step (session 24, 1ab13fd, four alternating
# pairs, results/quest_maxima_from_scores_h200.jsonl): 8.312-8.316 ms against 8.327-8.329.
MAXIMA_FROM_SCORES = True

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


def shortlist_groups(P: int, top: int, max_groups: int = MAX_GROUPS) -> int | None:
    """The shortlist's pages a group for a `P`-page table and `top` pages to take, or None
    when the shortlist cannot help (fewer groups than pages to take)."""
    group = max(2, next_pow2(cdiv(P, max_groups)))
    if not GROUPS_PER_PICK or cdiv(P, group) >= SHRINK_BELOW * top:
        return group
    fit = P // (GROUPS_PER_PICK * top)  # the largest group size leaving GROUPS_PER_PICK groups a pick
    fit = 1 << (fit.bit_length() - 1) if fit else 1
    group = max(2, next_pow2(cdiv(P, MAX_BLOCK_G)), min(group, fit))
    return group if cdiv(P, group) >= top else None


def maxima_group(P: int, page_size: int, budget: int, block_p: int) -> int | None:
    """The shortlist's group for a `P`-page table (`quest_select_pages_triton`'s default
    choice), when `MAXIMA_FROM_SCORES` has the page scores' launch (tiles of `block_p` pages)
    take its maxima: None when off, with no shortlist, or a group that does not divide a tile."""
    group = shortlist_groups(P, top_pages(budget, page_size)) if MAXIMA_FROM_SCORES else None
    return group if group is not None and block_p % group == 0 else None


def top_pages(budget: int, page_size: int) -> int:
    """The middle pages Quest takes at most: `max(3, budget // page_size)` (METHODS.md)."""
    return max(3, budget // page_size)


def shortlist_room(top: int) -> int:
    """The shortlist's default room for `top` pages to take: `next_pow2(4 * top)` within [16, 4096]."""
    return min(4096, max(16, next_pow2(4 * top)))


def choice_args(scores, kv_lens, page_size, sink_tokens, recent_tokens, budget) -> tuple[int, ...]:
    """`(B, Hkv, P, page_size, sink, recent, budget)` of a page choice's arguments, checked
    (every implementation's: this kernel, `quest_select_cuda`)."""
    check_scores(scores, (3,), "[B, Hkv, P]")
    B, H, P = scores.shape
    check_lens(kv_lens, B)
    return (B, H, P, int_arg("page_size", page_size, 1), int_arg("sink_tokens", sink_tokens, 0),
            int_arg("recent_tokens", recent_tokens, 0), int_arg("budget", budget, 0))


def quest_select_pages_triton(scores, kv_lens, page_size, sink_tokens, recent_tokens, budget, *,
                              block_p: int | None = None, num_warps: int | None = None, radix_bits: int | None = None,
                              shortlist: bool = True, shortlist_cap: int | None = None,
                              max_groups: int = MAX_GROUPS, group_maxima=None):
    """`block_p`: pages per block (a power of two; capped at P's; default `BLOCK_P`);
    `num_warps`: default `NUM_WARPS`, else one warp per 512 pages of the block, 1 to 16;
    `radix_bits`: key bits the searches settle per pass (1, 2 or 4: 32, 16 or 8 passes of 2,
    4 or 16 counts; default 4 on the shortlist, 2 in the full search, the fastest of each at
    the 128K shape). `shortlist`: search a
    shortlist of candidates first (below), the row cut into at most `max_groups` groups (fewer
    pages a group where that leaves under `SHRINK_BELOW` groups a page to take, none where
    even `MAX_BLOCK_G` groups are too few: the full search alone, `shortlist_groups`);
    `shortlist_cap`: its room (a power of two; default `shortlist_room(top)`), a row with
    more candidates runs the full search. `group_maxima`: the shortlist's group maxima
    `[B, Hkv, ceil(P / group)]` already taken over the middle pages (the page scores' launch
    gives them: `quest.quest_page_scores_and_maxima_triton` with `maxima_group`'s
    group), so the shortlist starts from them instead of reading the row in groups."""
    # methods.quest imports this package: read its width rule at call time
    from sparseengine.methods.quest import selection_width

    B, H, P, ps, sink, recent, budget = choice_args(scores, kv_lens, page_size, sink_tokens, recent_tokens, budget)
    block_p = int_arg("block_p", BLOCK_P if block_p is None else block_p, 16)
    num_warps = num_warps or NUM_WARPS
    if block_p & (block_p - 1):
        raise ValueError(f"block_p must be a power of two, got {block_p}")
    if radix_bits not in (None, 1, 2, 4):
        raise ValueError(f"radix_bits must be 1, 2 or 4, got {radix_bits!r}")
    device = check_launch(scores, kv_lens)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    K = min(selection_width(ps, sink, budget, recent), P)
    # Not _common.empty: its test poison is NaN, which integer tensors cannot hold (the
    # tests here poison torch.empty instead).
    pages = torch.empty((B, H, K), dtype=torch.int64, device=device)
    counts = torch.empty((B, H), dtype=torch.int32, device=device)
    if B * H == 0:
        return pages, counts
    block_p = min(block_p, max(16, next_pow2(P)))
    top = top_pages(budget, ps)
    group = shortlist_groups(P, top, int_arg("max_groups", max_groups, 1)) if shortlist else None
    shortlist, group = group is not None, group or 2
    cap = shortlist_cap or shortlist_room(top)
    if cap & (cap - 1) or cap < 16:
        raise ValueError(f"shortlist_cap must be a power of two >= 16, got {cap}")
    given = group_maxima is not None
    if given and (not shortlist or not isinstance(group_maxima, torch.Tensor)
                  or tuple(group_maxima.shape) != (B, H, cdiv(P, group)) or not group_maxima.is_floating_point()
                  or not group_maxima.is_contiguous() or group_maxima.device != scores.device):
        want = f"[{B}, {H}, {cdiv(P, group)}] floating (groups of {group})" if shortlist else "none (no shortlist here)"
        got = (f"{tuple(group_maxima.shape)} {group_maxima.dtype}" if isinstance(group_maxima, torch.Tensor)
               else type(group_maxima).__name__)
        raise ValueError(f"group_maxima must be {want}, contiguous on the scores' device, got {got}")
    block_g = max(16, next_pow2(cdiv(P, group)))
    row_scratch = 2 * cap if given else max(2 * cap, block_g)  # the groups' maxima, then the candidates' keys and pages
    scratch = torch.empty((B * H, row_scratch) if shortlist else (1, 1), dtype=torch.int32, device=device)
    _select_kernel[(B * H,)](
        scores, kv_lens, pages, counts, scratch, group_maxima if given else scores, scores.stride(0),
        scores.stride(1), H, P, K, cdiv(P, group),
        PAGE_SIZE=ps, SINK_PAGES=cdiv(sink, ps), RECENT=recent, TOTAL=sink + budget + recent,
        TOP=top, BLOCK_P=block_p, BLOCK_K=min(1024, max(16, next_pow2(K))),
        RADIX_BITS=radix_bits or 2, SHORT_RADIX=radix_bits or 4, SHORTLIST=shortlist, GROUP=group,
        BLOCK_G=block_g, CAP=cap, L_BITS=L_BITS, SCRATCH=row_scratch, GIVEN_MAXIMA=given,
        num_warps=num_warps or min(16, max(1, block_p // 512)),
    )
    return pages, counts


def _page_keys(row, offs, P):
    """int32 keys of the scores at `offs` (those < P), ordered as the floats; -0.0 is +0.0."""
    s = tl.load(row + offs, mask=offs < P, other=0.0).to(tl.float32)
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: larger magnitude, smaller key


def _kth_largest(keys, ok, m, RADIX_BITS: tl.constexpr, BITS: tl.constexpr = 32):
    """The m-th largest of the int32 `keys` where `ok` (a register block), RADIX_BITS key
    bits a pass; the minimum int32 when fewer than m are ok. With BITS < 32 only the top
    BITS bits are settled (the rest left 0): a lower bound of that key, still with at least
    m keys >= it. The search runs on uint32 (the keys with their sign bit flipped: the
    same order): a candidate `lo + digit * step` has zeros in the bits still open, so it
    never passes 2^32."""
    ukeys = (keys ^ -2147483648).to(tl.uint32, bitcast=True)
    lo = tl.zeros([], tl.uint32)
    digit = tl.arange(0, 1 << RADIX_BITS).to(tl.uint32)
    step = tl.full([], 1 << (32 - RADIX_BITS), tl.uint32)
    for _ in range(BITS // RADIX_BITS):
        cand = lo + digit * step
        cnt = tl.sum((ok[:, None] & (ukeys[:, None] >= cand[None, :])).to(tl.int32), 0)
        lo = lo + tl.max(tl.where(cnt >= m, digit, 0), 0) * step  # digit 0 always qualifies
        step = step >> RADIX_BITS
    return lo.to(tl.int32, bitcast=True) ^ -2147483648


def _shortlist_select(row, maxima_row, n_groups, out, keys_out, P, K, mid_end, m, active, SINK_PAGES: tl.constexpr,
                      GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, CAP: tl.constexpr,
                      RADIX_BITS: tl.constexpr, L_BITS: tl.constexpr, GIVEN_MAXIMA: tl.constexpr):
    """Where `active`, choose the m middle pages through a shortlist of candidates (kept in
    this row's scratch `keys_out`: first the groups' maxima, then CAP keys and CAP pages) and write them at slots
    SINK_PAGES.. ascending. Returns whether the row still needs the full search: it is
    not active (every middle page is taken: the full search's two passes do that), or it
    has more than CAP candidates."""
    n_cand = tl.zeros([], tl.int32)
    if active:
        # L <= the m-th largest of the middle groups' maxima (GROUP pages a group): at least
        # m middle keys are >= L, so the m-th largest key t is >= L and every key the
        # choice takes (ties at t included) is a candidate >= L. At most GROUP * m of them
        # when the groups' maxima are distinct; typically about m.
        g = tl.arange(0, BLOCK_G)
        g_ok = ((g + 1) * GROUP > SINK_PAGES) & (g * GROUP < mid_end)
        if GIVEN_MAXIMA:  # the page scores' launch took them over the middle pages
            gmax = _page_keys(maxima_row, g, n_groups)
        else:
            grid = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # one load of the row, a group a row
            in_mid = (grid >= SINK_PAGES) & (grid < mid_end)
            gmax = tl.max(tl.where(in_mid, _page_keys(row, grid, P), -2147483648), 1)
            # Through scratch and back: the max over the groups' axis leaves the maxima in a
            # sliced register layout, where each search pass took ~0.7 us against ~0.45 read
            # back as a plain vector (H200, results/quest_select_stages_h200.jsonl).
            tl.store(keys_out + g, gmax)
            tl.debug_barrier()
            gmax = tl.load(keys_out + g)
            tl.debug_barrier()  # every read back before the candidates overwrite the slots
        # L's top L_BITS bits only: a lower bound of the m-th largest maximum, so the choice
        # stays exact; it lets in the few keys within 2^-7 below it as extra candidates.
        low = _kth_largest(gmax, g_ok, m, RADIX_BITS, L_BITS)
        # The candidates, in page order, into this row's scratch (keys, then pages).
        n_cand = tl.zeros([], tl.int32)
        for p0 in range(0, mid_end, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            key = _page_keys(row, offs, P)
            is_cand = ((offs >= SINK_PAGES) & (offs < mid_end) & (key >= low)).to(tl.int32)
            slot = n_cand + tl.cumsum(is_cand, 0) - is_cand
            keep = (is_cand > 0) & (slot < CAP)
            tl.store(keys_out + slot, key, mask=keep)
            tl.store(keys_out + CAP + slot, offs, mask=keep)
            n_cand += tl.sum(is_cand, 0)
        if n_cand <= CAP:
            tl.debug_barrier()  # this program's scratch stores before its loads
            c = tl.arange(0, CAP)
            c_ok = c < n_cand
            key = tl.load(keys_out + c, mask=c_ok, other=-2147483648)
            t = _kth_largest(key, c_ok, m, RADIX_BITS)
            ties = m - tl.sum((c_ok & (key > t)).to(tl.int32), 0)
            eq = (c_ok & (key == t)).to(tl.int32)
            pick = (c_ok & ((key > t) | ((eq > 0) & (tl.cumsum(eq, 0) - eq < ties)))).to(tl.int32)
            slot = SINK_PAGES + tl.cumsum(pick, 0) - pick
            page = tl.load(keys_out + CAP + c, mask=c_ok, other=0)
            tl.store(out + slot, page.to(tl.int64), mask=(pick > 0) & (slot < K))
    return (active == 0) | (n_cand > CAP)


@lazy_jit
def _select_kernel(
    scores_ptr, kv_lens_ptr, pages_ptr, counts_ptr, scratch_ptr, maxima_ptr, stride_sb, stride_sh, HKV, P, K,
    N_GROUPS,
    PAGE_SIZE: tl.constexpr, SINK_PAGES: tl.constexpr, RECENT: tl.constexpr, TOTAL: tl.constexpr,
    TOP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, RADIX_BITS: tl.constexpr,
    SHORT_RADIX: tl.constexpr,
    SHORTLIST: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, CAP: tl.constexpr, L_BITS: tl.constexpr,
    SCRATCH: tl.constexpr, GIVEN_MAXIMA: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // HKV
    row = scores_ptr + b.to(tl.int64) * stride_sb + (pid % HKV).to(tl.int64) * stride_sh
    out = pages_ptr + pid.to(tl.int64) * K
    n = tl.load(kv_lens_ptr + b).to(tl.int32)
    n_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
    if RECENT > 0:
        recent_first = tl.maximum(n - RECENT, 0) // PAGE_SIZE  # the first page with a recent token
    else:
        recent_first = n_pages
    everything = (n <= TOTAL) | (recent_first <= SINK_PAGES)
    m = tl.minimum(recent_first - SINK_PAGES, TOP)  # middle pages to take (when not everything)
    count = tl.where(everything, n_pages, SINK_PAGES + m + n_pages - recent_first)
    tl.store(counts_ptr + pid, count)

    # Slots [0, sink_pages) and [sink_pages + m, count) hold consecutive pages; -1 after.
    for j0 in range(0, K, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        head = everything | (j < SINK_PAGES)
        page = tl.where(head, j, recent_first + (j - SINK_PAGES - m))
        page = tl.where(j < count, page, -1)
        tl.store(out + j, page.to(tl.int64), mask=(j < K) & (head | (j >= SINK_PAGES + m)))

    mid_end = tl.minimum(recent_first, P)  # == recent_first for a valid kv_len
    partial = everything == 0  # some middle pages are chosen: a search
    full_search = partial
    if SHORTLIST:
        full_search = partial & _shortlist_select(
            row, maxima_ptr + pid.to(tl.int64) * N_GROUPS, N_GROUPS, out, scratch_ptr + pid.to(tl.int64) * SCRATCH,
            P, K, mid_end, m, partial & (recent_first - SINK_PAGES > TOP), SINK_PAGES, GROUP, BLOCK_G, BLOCK_P,
            CAP, SHORT_RADIX, L_BITS, GIVEN_MAXIMA)
    if full_search:
        # The middle pages are [SINK_PAGES, mid_end). Blocks start at multiples of BLOCK_P,
        # so the loads stay aligned (vectorised); `ok` masks the sink pages of block 0.
        # lo: the m-th largest middle key, RADIX_BITS bits a pass (int64: lo + j * step may
        # pass 2^31, and then no key reaches it).
        lo = tl.full([], -2147483648, tl.int64)
        if recent_first - SINK_PAGES > TOP:  # else every middle page is taken: lo stays the minimum
            digit = tl.arange(0, 1 << RADIX_BITS).to(tl.int64)
            step = tl.full([], 1 << (32 - RADIX_BITS), tl.int64)
            for _ in range(32 // RADIX_BITS):
                cand = lo + digit * step  # [2^RADIX_BITS]
                cnt = tl.zeros([1 << RADIX_BITS], tl.int32)
                for p0 in range(0, mid_end, BLOCK_P):
                    offs = p0 + tl.arange(0, BLOCK_P)
                    ok = (offs >= SINK_PAGES) & (offs < mid_end)
                    key = _page_keys(row, offs, P)
                    ge = ok[:, None] & (key.to(tl.int64)[:, None] >= cand[None, :])
                    cnt += tl.sum(ge.to(tl.int32), 0)
                lo = lo + tl.max(tl.where(cnt >= m, digit, 0), 0) * step  # digit 0 always qualifies
                step = step >> RADIX_BITS
        t = lo.to(tl.int32)
        gt = tl.zeros([BLOCK_P], tl.int32)
        for p0 in range(0, mid_end, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            ok = (offs >= SINK_PAGES) & (offs < mid_end)
            gt += (ok & (_page_keys(row, offs, P) > t)).to(tl.int32)
        ties = m - tl.sum(gt, 0)  # keys equal to t to take, earliest first (0 when lo stayed the minimum)
        taken = tl.zeros([], tl.int32)
        tied = tl.zeros([], tl.int32)
        for p0 in range(0, mid_end, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            ok = (offs >= SINK_PAGES) & (offs < mid_end)
            key = _page_keys(row, offs, P)
            eq = (ok & (key == t)).to(tl.int32)
            chosen = ok & ((key > t) | ((eq > 0) & (tied + tl.cumsum(eq, 0) - eq < ties)))
            pick = chosen.to(tl.int32)
            slot = SINK_PAGES + taken + tl.cumsum(pick, 0) - pick  # exclusive rank among chosen pages
            tl.store(out + slot, offs.to(tl.int64), mask=chosen & (slot < K))
            taken += tl.sum(pick, 0)
            tied += tl.sum(eq, 0)
