import pytest
import torch

from sparseengine.kernels import (middle_group_maxima_ref, paged_kv_write_ref, quest_page_scores_and_maxima_triton,
                                  quest_page_scores_ref, quest_page_scores_triton, update_page_minmax_ref,
                                  update_page_minmax_triton)
from sparseengine.kernels.bench_quest import SCORE_LAUNCHES  # the launches the GPU sweep times
from sparseengine.kernels.testing import CASES, assert_close, case_id, random_paged_kv, randn


def _nan_meta(kv):
    n, _, hkv, d = kv.k_cache.shape
    return torch.full((n, hkv, d), float("nan"), dtype=kv.k_cache.dtype, device=kv.k_cache.device)


def _dense_minmax(kv, b):
    """Per logical page of request b: channel max/min over its valid tokens."""
    k, ps = kv.dense(b)[0], kv.page_size
    pages = -(-k.shape[0] // ps)
    return (torch.stack([k[p * ps:(p + 1) * ps].amax(0) for p in range(pages)]),
            torch.stack([k[p * ps:(p + 1) * ps].amin(0) for p in range(pages)]))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_update_page_minmax(case, gen, device):
    hq, hkv, d, ps, lens = case
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, device=device)
    # step 1: "prefill" all but the last token of each request (slots in shuffled order)
    prefix = torch.cat([kv.slots(b)[:-1] for b in range(len(lens))])
    shuffled = prefix[torch.randperm(len(prefix), generator=gen).to(device)]
    hi_ref, lo_ref, hi, lo = (_nan_meta(kv) for _ in range(4))
    update_page_minmax_ref(kv.k_cache, prefix, hi_ref, lo_ref)
    update_page_minmax_triton(kv.k_cache, torch.cat([shuffled, torch.tensor([-1], device=device)]), hi, lo)
    assert_close(hi, hi_ref, 1e-6, "prefill max")
    assert_close(lo, lo_ref, 1e-6, "prefill min")
    # step 2: "decode" one token per request, written over fresh random values
    last = torch.stack([kv.slots(b)[-1] for b in range(len(lens))])
    new_k = randn(len(lens), hkv, d, generator=gen, device=device)
    paged_kv_write_ref(new_k, new_k, kv.k_cache, kv.v_cache, last)
    update_page_minmax_ref(kv.k_cache, last, hi_ref, lo_ref)
    update_page_minmax_triton(kv.k_cache, last, hi, lo)
    assert_close(hi, hi_ref, 1e-6, "decode max")
    assert_close(lo, lo_ref, 1e-6, "decode min")
    for b in range(len(lens)):
        pages = kv.page_table[b, : -(-lens[b] // ps)].long()
        dense_hi, dense_lo = _dense_minmax(kv, b)
        assert torch.equal(hi_ref[pages], dense_hi) and torch.equal(lo_ref[pages], dense_lo)


def _read(scores, kv_lens, ps):
    """The scores as their consumers read them: a request's pages only. The Triton kernel
    leaves the tiles wholly past a request's pages unwritten; -inf there, as the reference."""
    n_pages = (kv_lens.long() + ps - 1) // ps
    past = torch.arange(scores.shape[-1], device=scores.device)[None, :] >= n_pages[:, None]
    return scores.masked_fill(past[:, None, :], float("-inf"))


def _scored_cache(case, gen, device):
    """A random paged cache with exact page bounds (NaN elsewhere) and a query: `(kv,
    (q, kmax, kmin, page_table, kv_lens, page_size))`."""
    hq, hkv, d, ps, lens = case
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, device=device)
    hi, lo = _nan_meta(kv), _nan_meta(kv)
    for b in range(len(lens)):
        if lens[b]:  # a request of no tokens has no pages
            pages = kv.page_table[b, : -(-lens[b] // ps)].long()
            hi[pages], lo[pages] = _dense_minmax(kv, b)
    q = randn(len(lens), hq, d, generator=gen, device=device)
    return kv, (q, hi, lo, kv.page_table, kv.kv_lens, ps)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_page_scores(case, gen, device):
    hq, hkv, d, ps, lens = case
    g = hq // hkv
    kv, args = _scored_cache(case, gen, device)
    q = args[0]
    ref = quest_page_scores_ref(*args)
    assert_close(_read(quest_page_scores_triton(*args), args[4], ps), ref, 1e-4)
    # plainest check: a channel loop; and U bounds every q.k in the page
    for b, n in enumerate(lens):
        k = kv.dense(b)[0]
        for h in range(hkv):
            for p in range(-(-n // ps)):
                kp = k[p * ps:(p + 1) * ps, h]
                u = max(sum(max(q[b, j, c] * kp[:, c].max(), q[b, j, c] * kp[:, c].min()) for c in range(d))
                        for j in range(h * g, (h + 1) * g))
                assert abs(ref[b, h, p] - u) <= 1e-4 * abs(u) + 1e-5
                assert ref[b, h, p] >= (q[b, h * g:(h + 1) * g] @ kp.T).max() - 1e-4
        assert torch.isneginf(ref[b, :, -(-n // ps):]).all()


# (iters, keep the tiles and store them after the loop)
TILINGS = [(2, False), (3, False), (1, True), (2, True), (4, True)]


@pytest.mark.parametrize("iters,keep", TILINGS, ids=lambda v: str(v))
def test_page_scores_loop_over_tiles(iters, keep, gen, device):
    """Several 16-page tiles per program: 75 and 38 pages of 4 tokens, so the programs'
    last tiles are partial or empty; each tile stored at once or all after the loop."""
    _, args = _scored_cache((8, 2, 32, 4, [300, 150]), gen, device)
    got = quest_page_scores_triton(*args, block_p=16, iters=iters, keep_tiles=keep)
    assert_close(_read(got, args[4], 4), quest_page_scores_ref(*args), 1e-4)


def test_page_scores_bad_launch(gen, device):
    _, args = _scored_cache(CASES[1], gen, device)
    with pytest.raises(ValueError, match="iters must be a power of two when the tiles are kept, got 3"):
        quest_page_scores_triton(*args, block_p=16, iters=3, keep_tiles=True)
    with pytest.raises(ValueError, match="iters must be an int >= 1, got 0"):
        quest_page_scores_triton(*args, block_p=16, iters=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'stages'"):
        quest_page_scores_triton(*args, stages=2)


def test_page_scores_skip_the_tiles_past_a_request(gen, device):
    """A short request in a wide page table: the programs wholly past its pages exit
    without writing (the buffer's NaN poison stays), the rest score as the reference."""
    _, args = _scored_cache((8, 2, 32, 4, [300, 20]), gen, device)  # 75 and 5 pages, 16-page tiles
    got = quest_page_scores_triton(*args, block_p=16, iters=1)
    assert torch.isnan(got[1, :, 16:]).all()  # tiles 1.. of the 5-page request: not written
    assert not torch.isnan(got[0]).any() and not torch.isnan(got[1, :, :16]).any()
    assert_close(_read(got, args[4], 4), quest_page_scores_ref(*args), 1e-4)


def _decode_step(kv, gen, device):
    """Bounds exact over all but each request's last token (NaN elsewhere), then a decode
    step: fresh keys written at the last slots. Returns the bounds before the step, the
    bounds the update makes of them, and the step's slots."""
    B = len(kv.kv_lens)
    hi, lo = _nan_meta(kv), _nan_meta(kv)
    update_page_minmax_ref(kv.k_cache, torch.cat([kv.slots(b)[:-1] for b in range(B)]), hi, lo)
    last = torch.stack([kv.slots(b)[-1] for b in range(B)])
    new_k = randn(B, *kv.k_cache.shape[2:], generator=gen, dtype=kv.k_cache.dtype, device=device)
    paged_kv_write_ref(new_k, new_k, kv.k_cache, kv.v_cache, last)
    want_hi, want_lo = hi.clone(), lo.clone()
    update_page_minmax_ref(kv.k_cache, last, want_hi, want_lo)
    return (hi, lo), (want_hi, want_lo), last


def _with_padding_row(kv, last):
    """The step's page table, lengths and slots with a CUDA graph's padding row appended:
    page table zeros, length 1, slot -1 (it must write and fold nothing)."""
    dev = kv.page_table.device
    table = torch.cat([kv.page_table, torch.zeros_like(kv.page_table[:1])])
    lens = torch.cat([kv.kv_lens, torch.ones(1, dtype=kv.kv_lens.dtype, device=dev)])
    return table, lens, torch.cat([last, torch.full((1,), -1, dtype=last.dtype, device=dev)])


@pytest.mark.parametrize("pdl,iters", [(False, 2), (True, 2), (True, 1)],
                         ids=["fold_first", "fold_after_loads", "fold_after_loads_1tile"])
@pytest.mark.parametrize("case", CASES + [(8, 2, 32, 4, [9, 7, 300, 64])], ids=case_id)
def test_page_scores_fold_the_step_keys(case, pdl, iters, gen, device):
    """Given the step's slots, the scoring first folds each request's new key into its
    page's bounds (offset 0 starts a page afresh: 9 and 300 tokens of pages of 4 end at
    offset 0, 7 at 2), the same bounds the update makes, and scores with them; the padding
    row folds nothing. 300 tokens in tiles of 16, two a program: the last page is program 2's.
    `pdl`: the order a PDL launch takes (the tiles loaded before the fold, the folded page
    scored from its new bounds; the wait itself only on a GPU)."""
    hq, hkv, d, ps, lens = case
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, device=device)
    (hi, lo), (want_hi, want_lo), last = _decode_step(kv, gen, device)
    table, kv_lens, slots = _with_padding_row(kv, last)
    q = randn(len(lens) + 1, hq, d, generator=gen, device=device)
    want = quest_page_scores_ref(q, want_hi, want_lo, table, kv_lens, ps)
    got = quest_page_scores_triton(q, hi, lo, table, kv_lens, ps, k_cache=kv.k_cache, new_slots=slots,
                                   block_p=16, iters=iters, pdl=pdl)
    torch.testing.assert_close(hi, want_hi, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lo, want_lo, rtol=0, atol=0, equal_nan=True)
    assert_close(_read(got, kv_lens, ps)[:-1], want[:-1], 1e-4)


def test_page_scores_fold_needs_cache_and_slots(gen, device):
    kv, args = _scored_cache(CASES[1], gen, device)
    with pytest.raises(ValueError, match="k_cache and new_slots go together"):
        quest_page_scores_triton(*args, k_cache=kv.k_cache)
    with pytest.raises(ValueError, match=r"new_slots must be an integer \[B=3\] tensor"):
        quest_page_scores_triton(*args, k_cache=kv.k_cache, new_slots=torch.zeros(2, dtype=torch.long,
                                                                                   device=device))
    with pytest.raises(ValueError, match="k_cache must be"):
        quest_page_scores_triton(*args, k_cache=kv.v_cache[:1], new_slots=kv.kv_lens.long())
    with pytest.raises(ValueError, match=r"pdl=True needs the fold \(k_cache, new_slots\)"):
        quest_page_scores_triton(*args, pdl=True)


def _written_groups(maxima, kv_lens, ps, group):
    """The maxima as the selection reads them: the groups up to a request's last page
    (the tiles wholly past it are not written); -inf past them, as the reference."""
    n_groups = -(-((kv_lens.long() + ps - 1) // ps) // group)
    past = torch.arange(maxima.shape[-1], device=maxima.device)[None, :] >= n_groups[:, None]
    return maxima.masked_fill(past[:, None, :], float("-inf"))


@pytest.mark.parametrize("group,sink_pages,recent", [(2, 1, 5), (4, 0, 0), (8, 3, 16), (16, 2, 9), (1, 1, 4)])
@pytest.mark.parametrize("fold,keep,pdl", [(False, False, False), (True, False, False), (False, True, False),
                                           (True, True, False), (True, False, True), (True, True, True)])
def test_scores_and_middle_group_maxima(group, sink_pages, recent, fold, keep, pdl, gen, device):
    """One launch gives the scores, equal to the scores' launch alone, and each group's
    maximum over the request's middle pages (sink pages and the pages from the first
    recent token's on excluded; -inf for a group with none), as the torch twin takes them
    from those scores: requests of 300, 150, 9 and 1 tokens in pages of 4, tiles of 16
    (stored a tile at a time or after the loop; folded first or after the tiles' loads)."""
    hq, hkv, d, ps, lens = 8, 2, 32, 4, [300, 150, 9, 1]
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, device=device)
    (hi, lo), _, last = _decode_step(kv, gen, device)
    if not fold:
        update_page_minmax_ref(kv.k_cache, last, hi, lo)
    new_keys = {"k_cache": kv.k_cache, "new_slots": last} if fold else {}
    q = randn(len(lens), hq, d, generator=gen, device=device)
    args = (q, hi, lo, kv.page_table, kv.kv_lens, ps)
    tiling = {"block_p": 16, "iters": 2, "keep_tiles": keep}
    scores, maxima = quest_page_scores_and_maxima_triton(
        *args, group=group, sink_pages=sink_pages, recent_tokens=recent, **new_keys, **tiling, pdl=pdl)
    assert maxima.shape == (len(lens), hkv, -(-kv.page_table.shape[1] // group)) and maxima.dtype == torch.float32
    want = middle_group_maxima_ref(_read(scores, kv.kv_lens, ps), kv.kv_lens, ps, group, sink_pages, recent)
    assert torch.equal(_written_groups(maxima, kv.kv_lens, ps, group), _written_groups(want, kv.kv_lens, ps, group))
    alone = _read(quest_page_scores_triton(*args, **tiling), kv.kv_lens, ps)  # the bounds are folded by now
    if pdl:  # the folded page's score summed in another order than the dot's
        assert_close(_read(scores, kv.kv_lens, ps), alone, 1e-6)
    else:  # the same scores
        assert torch.equal(_read(scores, kv.kv_lens, ps), alone)
    assert_close(_read(scores, kv.kv_lens, ps), quest_page_scores_ref(*args), 1e-4)
    assert torch.isfinite(maxima[0, :, 1]).all()  # the 300-token request's second group: middle pages


def test_middle_group_maxima_ref_by_hand():
    scores = torch.tensor([[[5.0, 1.0, 7.0, 2.0, 3.0, 9.0, 4.0, 0.5]]])  # one request, 8 pages of 2 tokens
    # 15 tokens: 8 pages; sink page 0 and the pages from (15 - 4) // 2 = 5 on are not middle
    got = middle_group_maxima_ref(scores, torch.tensor([15]), 2, 3, 1, 4)
    assert got.tolist() == [[[7.0, 3.0, float("-inf")]]]  # groups [0, 3), [3, 6), [6, 8) + padding


def test_scores_and_maxima_bad_group(gen, device):
    _, args = _scored_cache(CASES[1], gen, device)
    with pytest.raises(ValueError, match="group must be a positive divisor of block_p=16, got 3"):
        quest_page_scores_and_maxima_triton(*args, group=3, sink_pages=1, recent_tokens=4, block_p=16)
    with pytest.raises(ValueError, match="sink_pages and recent_tokens must be ints >= 0"):
        quest_page_scores_and_maxima_triton(*args, group=4, sink_pages=-1, recent_tokens=4, block_p=16)


@pytest.mark.gpu
def test_gpu_32k(gen):
    lens, hkv, d, ps = [32768, 5000], 8, 128, 16
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=torch.bfloat16, device="cuda")
    slots = torch.cat([kv.slots(b) for b in range(2)])
    metas = [torch.zeros(kv.k_cache.shape[0], hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    update_page_minmax_ref(kv.k_cache, slots, metas[0], metas[1])
    update_page_minmax_triton(kv.k_cache, slots, metas[2], metas[3])
    assert torch.equal(metas[0], metas[2]) and torch.equal(metas[1], metas[3])
    q = randn(2, 32, d, generator=gen, dtype=torch.bfloat16, device="cuda")
    args = (q, metas[0], metas[1], kv.page_table, kv.kv_lens, ps)
    assert_close(_read(quest_page_scores_triton(*args), kv.kv_lens, ps), quest_page_scores_ref(*args), 1e-3)
    # a decode step folded into the scoring, at the engine's tiling (8192 tiles of 128 pages)
    (hi, lo), (want_hi, want_lo), last = _decode_step(kv, gen, "cuda")
    table, kv_lens, slots = _with_padding_row(kv, last)
    q = randn(3, 32, d, generator=gen, dtype=torch.bfloat16, device="cuda")
    want = quest_page_scores_ref(q, want_hi, want_lo, table, kv_lens, ps)
    got = quest_page_scores_triton(q, hi, lo, table, kv_lens, ps, k_cache=kv.k_cache, new_slots=slots)
    torch.testing.assert_close(hi, want_hi, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lo, want_lo, rtol=0, atol=0, equal_nan=True)
    assert_close(_read(got, kv_lens, ps)[:-1], want[:-1], 1e-3)
    # every launch variant the benchmark sweeps, with the group maxima as the engine takes them
    for tiling in SCORE_LAUNCHES:
        got, maxima = quest_page_scores_and_maxima_triton(q, hi, lo, table, kv_lens, ps, group=32, sink_pages=4,
                                                          recent_tokens=512, **tiling)
        assert_close(_read(got, kv_lens, ps)[:-1], want[:-1], 1e-3)
        groups = middle_group_maxima_ref(_read(got, kv_lens, ps), kv_lens, ps, 32, 4, 512)
        written = _written_groups(maxima, kv_lens, ps, 32)[:-1]
        assert torch.equal(written, _written_groups(groups, kv_lens, ps, 32)[:-1]), tiling


@pytest.mark.gpu
def test_gpu_fold_after_loads_with_pdl(gen):
    """The PDL launch (`pdl=True`: the tiles loaded, then griddepcontrol.wait, then q, the
    key and the fold) at 32K in pages of 16, the engine's tiling: the bounds the update
    makes and the scores of the launch that folds first (the folded page's summed in
    another order), eagerly and replayed in a CUDA graph after a copy kernel writes q and
    the keys (the kernel before it, as the qkv linear in a decode step)."""
    lens, hkv, d, ps = [32768, 5000, 77], 8, 128, 16
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=torch.bfloat16, device="cuda")
    (hi, lo), (want_hi, want_lo), last = _decode_step(kv, gen, "cuda")
    table, kv_lens, slots = _with_padding_row(kv, last)
    q = randn(4, 32, d, generator=gen, dtype=torch.bfloat16, device="cuda")
    before, first = (hi.clone(), lo.clone()), (hi.clone(), lo.clone())
    want = quest_page_scores_triton(q, *first, table, kv_lens, ps, k_cache=kv.k_cache, new_slots=slots, pdl=False)
    for iters in (2, 1):  # the engine's two tiles a program (through cp.async), and one (into registers)
        bounds = (before[0].clone(), before[1].clone())
        torch.cuda.synchronize()  # the clones done: a PDL launch loads the bounds before its wait for the kernel before
        got = quest_page_scores_triton(q, *bounds, table, kv_lens, ps, k_cache=kv.k_cache, new_slots=slots,
                                       pdl=True, iters=iters)
        for b in (first, bounds):
            torch.testing.assert_close(b[0], want_hi, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(b[1], want_lo, rtol=0, atol=0, equal_nan=True)
        assert_close(_read(got, kv_lens, ps)[:-1], _read(want, kv_lens, ps)[:-1], 1e-6)
    q_in, k_in = torch.empty_like(q), kv.k_cache.clone()
    graph_bounds = [t.clone() for t in before]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_in.copy_(q)
        k_in.copy_(kv.k_cache)
        out = quest_page_scores_triton(q_in, *graph_bounds, table, kv_lens, ps, k_cache=k_in, new_slots=slots,
                                       pdl=True)
    for _ in range(3):
        q_in.zero_(), k_in.zero_()
        for t, b in zip(graph_bounds, before):  # the bounds before the step again
            t.copy_(b)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(graph_bounds[0], want_hi, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(graph_bounds[1], want_lo, rtol=0, atol=0, equal_nan=True)
        assert_close(_read(out, kv_lens, ps)[:-1], _read(want, kv_lens, ps)[:-1], 1e-6)


def test_page_scores_fp16(gen, device):
    hq, hkv, d, ps, lens = CASES[1]
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=torch.float16, device=device)
    hi = torch.zeros(kv.k_cache.shape[0], hkv, d, dtype=torch.float16, device=device)
    lo = hi.clone()
    update_page_minmax_triton(kv.k_cache, torch.cat([kv.slots(b) for b in range(len(lens))]), hi, lo)
    q = randn(len(lens), hq, d, generator=gen, dtype=torch.float16, device=device)
    args = (q, hi, lo, kv.page_table, kv.kv_lens, ps)
    assert_close(_read(quest_page_scores_triton(*args), kv.kv_lens, ps), quest_page_scores_ref(*args), 1e-3)
