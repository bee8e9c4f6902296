"""`quest_select_pages_triton` == `select_pages_batched` (the torch path) on distinct scores,
and == the per-request definition `quest_select_pages` (earlier page wins a tie) on scores
full of ties; through the shortlist of candidates, its fallback and the full search.
Scores past a request's pages are NaN: the contract says they are never read."""
import pytest
import torch
import torch.utils._device

from sparseengine.kernels import quest_select_pages_triton
from sparseengine.methods.quest import select_pages_batched
from sparseengine.methods.selection import quest_select_pages

# (kv_lens, Hkv, P, page_size, sink, budget, recent, block_p): ragged lengths, kv_len 0
# (a padded graph row), requests within the total, blocks smaller than the middle range.
CASES = [
    ([150, 9, 97, 0], 2, 40, 4, 4, 16, 8, 16),  # 9 <= total 28: all pages
    ([300, 50, 100, 49], 3, 20, 16, 20, 8, 20, 16),  # 50: sink and recent pages meet; 100: middle of 3 = top
    ([61, 64, 200, 28, 29], 2, 26, 8, 4, 24, 0, 16),  # no recent tokens: a partial last page competes
    ([16 * 300 + 5, 2000, 640], 4, 320, 16, 64, 512, 64, 64),  # top 32 of ~290 middle pages, 5 blocks
    ([16 * 300 + 5, 2000, 640], 4, 320, 16, 64, 512, 64, 4096),  # the same in one block
    ([23, 24, 70], 1, 20, 4, 0, 20, 3, 16),  # no sink
]


@pytest.fixture(autouse=True)
def _poison_torch_empty(monkeypatch):
    """The wrapper allocates its integer outputs with torch.empty (the conftest's NaN poison
    of _common.empty has no integer form): they start as -12345, so unwritten entries show."""
    real = torch.empty
    # `with torch.device(...)` finds its factories in a set it caches on first use: cached with the
    # replacement in it, it would pass over the real torch.empty for the rest of the process
    torch.utils._device._device_constructors()

    def poisoned(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_(-12345) if t.dtype in (torch.int32, torch.int64) else t

    monkeypatch.setattr(torch, "empty", poisoned)


def _case_id(c):
    lens, hkv, P, ps, sink, budget, recent, block = c
    return f"b{len(lens)}-hkv{hkv}-P{P}-ps{ps}-s{sink}b{budget}r{recent}-blk{block}"


def _scores(values: torch.Tensor, kv_lens, ps) -> torch.Tensor:
    """`values [B, Hkv, P]` with NaN past each request's pages."""
    P = values.shape[-1]
    n_pages = torch.tensor([-(-n // ps) for n in kv_lens])
    return values.masked_fill(torch.arange(P)[None, None, :] >= n_pages[:, None, None], float("nan"))


# How the middle pages are searched: the shortlist with room for every candidate (never
# the full search here), the shortlist with 16 slots (rows with more candidates fall back
# to the full search), the default, and the full search alone.
SEARCHES = {"shortlist": dict(shortlist_cap=4096), "fallback": dict(shortlist_cap=16), "default": {},
            "full": dict(shortlist=False)}


# (search, radix bits): the full search at each radix, the shortlist at its default and at 1
RUNS = [("full", 1), ("full", 2), ("full", 4), ("shortlist", None), ("shortlist", 1), ("fallback", None),
        ("default", None)]


@pytest.mark.parametrize("search,radix_bits", RUNS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_equals_torch_path_on_distinct_scores(case, radix_bits, search, gen, device):
    lens, hkv, P, ps, sink, budget, recent, block = case
    scores = _scores(torch.randn(len(lens), hkv, P, generator=gen), lens, ps).to(device)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    args = (scores, kv_lens, ps, sink, recent, budget)
    pages, counts = quest_select_pages_triton(*args, block_p=block, radix_bits=radix_bits, **SEARCHES[search])
    want_pages, want_counts = select_pages_batched(*args)
    assert pages.dtype == torch.int64 and counts.dtype == torch.int32
    assert torch.equal(counts, want_counts)
    assert torch.equal(pages, want_pages)


def test_the_launch_constants_are_read_at_each_call(monkeypatch, gen, device):
    """quest_select.BLOCK_P (what the engine launches with, A/B-able) is read at each call:
    blocks of 16 pages over a 40-page row take the same pages as the torch path, and a
    block that is not a power of two is refused by name."""
    from sparseengine.kernels import quest_select

    lens = [150, 9, 97, 0]
    scores = _scores(torch.randn(4, 2, 40, generator=gen), lens, 4).to(device)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    args = (scores, kv_lens, 4, 4, 8, 16)
    monkeypatch.setattr(quest_select, "BLOCK_P", 16)
    pages, counts = quest_select_pages_triton(*args, shortlist=False)
    want_pages, want_counts = select_pages_batched(*args)
    assert torch.equal(pages, want_pages) and torch.equal(counts, want_counts)
    monkeypatch.setattr(quest_select, "BLOCK_P", 24)
    with pytest.raises(ValueError, match="block_p must be a power of two, got 24"):
        quest_select_pages_triton(*args)


def test_shortlist_with_few_groups(gen, device):
    """Pages in groups of 4 (P past 2 * MAX_GROUPS): with fewer middle groups than pages to
    take, every middle page is a candidate; with more, the groups' maxima bound them."""
    from sparseengine.kernels.quest_select import MAX_GROUPS

    P, ps = 2 * MAX_GROUPS + 8, 1
    lens = [P, 200, 90]  # 90: fewer groups (~21) than the 24 pages to take
    values = torch.randn(len(lens), 2, P, generator=gen)
    # request 90, head 1: one high page a group, so the groups' maxima alone are too few
    # (middle pages 2..81 with sink 2: groups 0..20 of 4, the last one pages 80 and 81)
    page = torch.arange(P)
    values[2, 1] = torch.where((page % 4 == 2) | (page == 80), 10.0, -10.0) + values[2, 1]
    scores = _scores(values, lens, ps).to(device)
    for sink in (4, 2):  # 2: the first group holds middle pages too (no group of sink pages only)
        args = (scores, torch.tensor(lens, device=device), ps, sink, 8, 24)
        want = select_pages_batched(*args)
        for search in ("shortlist", "fallback"):
            for got, w in zip(quest_select_pages_triton(*args, block_p=1024, **SEARCHES[search]), want):
                assert torch.equal(got, w), (sink, search)


def test_shortlist_groups_when_picks_near_the_groups(monkeypatch):
    """The 128K table (8320 pages): totals 2048 and 4096 (top 92, 220) keep groups of 32
    (260 groups, over 1.1 a pick); total 8192 (top 476) takes groups of 16 (2 a pick would
    be 8, past 1024 maxima); total 16384 (top 988) has fewer groups than picks even so: no
    shortlist. With GROUPS_PER_PICK 0 the group comes from P alone, as before."""
    from sparseengine.kernels import quest_select

    assert [quest_select.shortlist_groups(8320, top) for top in (92, 220, 476, 988)] == [32, 32, 16, None]
    assert quest_select.shortlist_groups(1032, 24) == 4  # test_shortlist_with_few_groups's table
    monkeypatch.setattr(quest_select, "GROUPS_PER_PICK", 0)
    assert [quest_select.shortlist_groups(8320, top) for top in (92, 476, 988)] == [32, 32, 32]


@pytest.mark.parametrize("budget", [240, 600])
def test_many_pages_to_take(budget, gen, device):
    """Against the torch path where the pages to take come near the groups P alone would
    give (258 groups of 4): 240 picks take groups of 2 (516 maxima); 600 picks are more
    than even those, so the full search runs alone."""
    from sparseengine.kernels.quest_select import shortlist_groups

    P, ps, lens = 1032, 1, [1032, 900, 700]
    assert shortlist_groups(P, budget) == (2 if budget == 240 else None)
    scores = _scores(torch.randn(len(lens), 2, P, generator=gen), lens, ps).to(device)
    args = (scores, torch.tensor(lens, dtype=torch.int32, device=device), ps, 4, 8, budget)
    pages, counts = quest_select_pages_triton(*args, block_p=512)
    want_pages, want_counts = select_pages_batched(*args)
    assert torch.equal(counts, want_counts)
    assert torch.equal(pages, want_pages)


@pytest.mark.parametrize("search", ["shortlist", "default"])
def test_clustered_scores_above_the_settled_bound(search, gen, device):
    """The shortlist's bound L keeps only its top `L_BITS` key bits: scores within 2^-7 of
    each other share them, so pages below the exact m-th largest group maximum become
    candidates too (with room for all of them: the shortlist's own search; with the
    default room: the full search). The choice is still the definition's. Head 1 mixes a
    cluster just under a spread of higher pages."""
    lens, hkv, P, ps, sink, budget, recent = [16 * 300, 16 * 260 + 7], 2, 300, 16, 64, 512, 64
    values = 1.0 + 1e-3 * torch.rand(len(lens), hkv, P, generator=gen)  # distinct fp32, one bf16 value
    values[:, 1, ::7] += 1.0 + torch.rand(len(lens), (P + 6) // 7, generator=gen)
    scores = _scores(values, lens, ps).to(device)
    args = (scores, torch.tensor(lens, device=device), ps, sink, recent, budget)
    pages, counts = quest_select_pages_triton(*args, block_p=64, **SEARCHES[search])
    want_pages, want_counts = select_pages_batched(*args)
    assert torch.equal(counts, want_counts)
    assert torch.equal(pages, want_pages)


def test_strided_scores_and_int64_lengths(gen, device):
    """A view into a wider buffer (row stride != P), int64 kv_lens."""
    lens, ps, P = [130, 77], 4, 33
    wide = torch.randn(2, 3, P + 5, generator=gen)
    wide[..., :P] = _scores(wide[..., :P], lens, ps)
    scores = wide.to(device)[..., :P]
    args = (scores, torch.tensor(lens, device=device), ps, 3, 5, 12)
    for got, want in zip(quest_select_pages_triton(*args, block_p=16), select_pages_batched(*args)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_go_to_the_earlier_page(dtype, gen, device):
    """Scores from a handful of values (with -inf, +inf and both zeros): each (request, KV
    head) is the definition's choice, whose stable sort gives a tie to the earlier page."""
    lens, hkv, P, ps, sink, budget, recent = [16 * 90 + 3, 300, 1000, 40, 0], 3, 95, 16, 20, 160, 30
    palette = torch.tensor([-1.5, -0.0, 0.0, 0.25, 0.25, 2.0, float("-inf"), float("inf")])
    values = palette[torch.randint(0, 6, (len(lens), hkv, P), generator=gen)]
    values[0, 0, 30:40] = float("-inf")  # a run of -inf middle pages
    values[0, 1, 5:8] = float("inf")
    values[1, 2] = 0.5  # one value: the earliest pages of the middle win
    scores = _scores(values, lens, ps).to(dtype).to(device)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    runs = [(16, 2, "full"), (128, 1, "full"), (128, 4, "full"),  # 128 >= P: one block
            (16, 2, "shortlist"), (128, 1, "shortlist"), (16, None, "shortlist"), (16, 2, "fallback")]
    for block, radix_bits, search in runs:
        pages, counts = quest_select_pages_triton(scores, kv_lens, ps, sink, recent, budget, block_p=block,
                                                  radix_bits=radix_bits, **SEARCHES[search])
        for b, n in enumerate(lens):
            bounds = scores[b, :, : -(-n // ps)].cpu()
            want = quest_select_pages(bounds, n, ps, sink, recent, budget)
            for h in range(hkv):
                count = int(counts[b, h])
                where = f"{search}, block {block}, radix {radix_bits}, request {b} (n={n}), head {h}"
                assert count == want.shape[1], where
                assert pages[b, h, :count].tolist() == want[h].tolist(), where
                assert (pages[b, h, count:] == -1).all(), where


def _maxima(scores, kv_lens, ps, sink, budget, recent):
    """The shortlist's group maxima as the page scores' launch gives them (torch twin), for
    the group the selection takes at this table's width."""
    from sparseengine.kernels import middle_group_maxima_ref
    from sparseengine.kernels.quest_select import shortlist_groups

    group = shortlist_groups(scores.shape[-1], max(3, budget // ps))
    return middle_group_maxima_ref(scores, torch.as_tensor(kv_lens), ps, group, -(-sink // ps), recent)


@pytest.mark.parametrize("search", ["shortlist", "fallback", "default"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_given_group_maxima_choose_the_same_pages(case, search, gen, device):
    """With the group maxima given (the page scores' launch took them), the choice is the
    torch path's, through the shortlist, its fallback and the default room."""
    lens, hkv, P, ps, sink, budget, recent, block = case
    scores = _scores(torch.randn(len(lens), hkv, P, generator=gen), lens, ps).to(device)
    args = (scores, torch.tensor(lens, dtype=torch.int32, device=device), ps, sink, recent, budget)
    maxima = _maxima(scores, lens, ps, sink, budget, recent)
    got = quest_select_pages_triton(*args, block_p=block, group_maxima=maxima, **SEARCHES[search])
    for g, w in zip(got, select_pages_batched(*args)):
        assert torch.equal(g, w)


def test_given_group_maxima_with_ties(gen, device):
    """Scores from a handful of values: the definition's choice (ties to the earlier page)."""
    lens, hkv, P, ps, sink, budget, recent = [16 * 90 + 3, 300, 1000, 40, 0], 3, 95, 16, 20, 160, 30
    palette = torch.tensor([-1.5, -0.0, 0.0, 0.25, 0.25, 2.0, float("-inf"), float("inf")])
    scores = _scores(palette[torch.randint(0, 8, (len(lens), hkv, P), generator=gen)], lens, ps).to(device)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    maxima = _maxima(scores, lens, ps, sink, budget, recent)
    for search in ("shortlist", "fallback"):
        pages, counts = quest_select_pages_triton(scores, kv_lens, ps, sink, recent, budget, block_p=16,
                                                  group_maxima=maxima, **SEARCHES[search])
        for b, n in enumerate(lens):
            want = quest_select_pages(scores[b, :, : -(-n // ps)].cpu(), n, ps, sink, recent, budget)
            for h in range(hkv):
                assert pages[b, h, : int(counts[b, h])].tolist() == want[h].tolist(), (search, b, h)


def test_bad_group_maxima(device):
    lens = torch.tensor([40], dtype=torch.int32, device=device)
    scores = torch.zeros(1, 2, 10, device=device)
    with pytest.raises(ValueError, match=r"group_maxima must be \[1, 2, 5\] floating \(groups of 2\), contiguous "
                                         r"on the scores' device, got \(1, 2, 4\)"):
        quest_select_pages_triton(scores, lens, 4, 4, 4, 8, group_maxima=torch.zeros(1, 2, 4, device=device))
    with pytest.raises(ValueError, match="got list"):
        quest_select_pages_triton(scores, lens, 4, 4, 4, 8, group_maxima=[0.0] * 10)
    with pytest.raises(ValueError, match=r"group_maxima must be none \(no shortlist here\)"):
        quest_select_pages_triton(scores, lens, 4, 4, 4, 8, shortlist=False, group_maxima=torch.zeros(1, 2, 5))


def test_bad_inputs_name_the_value(device):
    lens = torch.tensor([40], dtype=torch.int32, device=device)
    scores = torch.zeros(1, 2, 10, device=device)
    with pytest.raises(ValueError, match=r"scores must be a floating \[B, Hkv, P\] tensor, got \(2, 10\)"):
        quest_select_pages_triton(scores[0], lens, 4, 4, 4, 8)
    with pytest.raises(ValueError, match="dtype torch.int64"):
        quest_select_pages_triton(scores.long(), lens, 4, 4, 4, 8)
    with pytest.raises(ValueError, match=r"kv_lens must be an integer \[B=1\] tensor, got shape \(2,\)"):
        quest_select_pages_triton(scores, torch.tensor([40, 3], device=device), 4, 4, 4, 8)
    with pytest.raises(ValueError, match="page_size must be an integer >= 1, got 0"):
        quest_select_pages_triton(scores, lens, 0, 4, 4, 8)
    with pytest.raises(ValueError, match="budget must be an integer >= 0, got -1"):
        quest_select_pages_triton(scores, lens, 4, 4, 4, -1)
    with pytest.raises(ValueError, match="block_p must be a power of two, got 48"):
        quest_select_pages_triton(scores, lens, 4, 4, 4, 8, block_p=48)
    with pytest.raises(ValueError, match="radix_bits must be 1, 2 or 4, got 3"):
        quest_select_pages_triton(scores, lens, 4, 4, 4, 8, radix_bits=3)
    with pytest.raises(ValueError, match="shortlist_cap must be a power of two >= 16, got 24"):
        quest_select_pages_triton(scores, lens, 4, 4, 4, 8, shortlist_cap=24)


@pytest.mark.gpu
def test_gpu_128k_total8192(gen):
    """Quest at total 8192 as the engine launches it (an 8320-page table, top 476: groups of
    16), against the torch path."""
    lens, hkv, P, ps, sink, budget, recent = [131072, 130000, 90000, 4097, 9000, 0], 8, 8320, 16, 64, 7616, 512
    scores = _scores(torch.randn(len(lens), hkv, P, generator=gen), lens, ps).cuda()
    args = (scores, torch.tensor(lens, dtype=torch.int32, device="cuda"), ps, sink, recent, budget)
    for g, w in zip(quest_select_pages_triton(*args), select_pages_batched(*args)):
        assert torch.equal(g, w)


@pytest.mark.gpu
def test_gpu_128k_batch6_and_cuda_graph(gen):
    """The profiled shape: B=6, Hkv=8, 8192 pages of 16; captured and replayed in a graph."""
    lens, hkv, P, ps, sink, budget, recent = [131072, 131000, 70000, 4097, 2100, 0], 8, 8192, 16, 64, 2048, 64
    scores = _scores(torch.randn(len(lens), hkv, P, generator=gen), lens, ps).cuda()
    kv_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    args = (scores, kv_lens, ps, sink, recent, budget)
    for block, radix_bits, search in ((1024, 2, "full"), (4096, 1, "full"), (8192, 1, "full"), (8192, 2, "full"),
                                      (8192, 4, "full"), (8192, 2, "default"), (8192, 1, "shortlist"),
                                      (8192, 2, "fallback")):
        got = quest_select_pages_triton(*args, block_p=block, radix_bits=radix_bits, **SEARCHES[search])
        for g, w in zip(got, select_pages_batched(*args)):
            assert torch.equal(g, w), (block, radix_bits, search)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pages, counts = quest_select_pages_triton(*args)
    for _ in range(2):
        scores.copy_(_scores(torch.randn(len(lens), hkv, P, generator=gen), lens, ps))
        pages.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        want_pages, want_counts = select_pages_batched(*args)
        assert torch.equal(pages, want_pages) and torch.equal(counts, want_counts)
    # ties at full size: a score from 4 values, checked for one request against the definition
    scores.copy_(_scores(torch.randint(0, 4, (len(lens), hkv, P), generator=gen).float(), lens, ps))
    graph.replay()
    want = quest_select_pages(scores[1, :, : -(-lens[1] // ps)].cpu(), lens[1], ps, sink, recent, budget)
    assert torch.equal(counts[1].cpu(), torch.full((hkv,), want.shape[1], dtype=torch.int32))
    assert torch.equal(pages[1, :, : want.shape[1]].cpu(), want)
