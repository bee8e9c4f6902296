"""`omnikv_select_triton` == `pick_tokens` (the torch path) over the max over heads, on
distinct scores, and == the definition with ties to the earlier token on scores full of
ties; with one block of tokens a request and with many.
Scores at or past a request's `n - recent` are NaN: the contract says they are never read."""
import pytest
import torch

from sparseengine.kernels import omnikv_select_triton
from sparseengine.methods.omnikv import pick_tokens

from .conftest import DEVICE

# (kv_lens, H, L, sink, budget, recent): ragged lengths, a request within the total, kv_len
# 0 (a padded graph row), no sink, no recent, a width that is not a multiple of the group.
CASES = [
    ([150, 9, 97, 0], 2, 160, 4, 16, 8),
    ([300, 50, 100, 49], 3, 300, 20, 8, 20),
    ([61, 64, 200, 28, 29], 1, 203, 4, 24, 0),
    ([16 * 300 + 5, 2000, 640], 4, 16 * 320, 64, 100, 64),
    ([23, 24, 70], 2, 77, 0, 20, 3),
]
# Launch knobs: the default (one block holds a small case's row); blocks of 16 and 64
# tokens (many blocks a request: the counts of the blocks before each one matter).
KNOBS = {"default": {}, "block16": dict(block=16), "block64": dict(block=64, num_warps=2)}


@pytest.fixture(autouse=True)
def _poison_torch_empty(monkeypatch):
    """The wrapper allocates its integer buffers with torch.empty: they start as -12345, so
    unwritten output entries show (and a scratch read before its write does too)."""
    real = torch.empty

    def poisoned(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(-12345) if t.dtype in (torch.int32, torch.int64) else t

    monkeypatch.setattr(torch, "empty", poisoned)


def _scores(values: torch.Tensor, kv_lens, recent) -> torch.Tensor:
    """`values [B, H, L]` with NaN from each request's `n - recent` on."""
    L = values.shape[-1]
    cut = torch.tensor([n - recent for n in kv_lens])
    return values.masked_fill(torch.arange(L)[None, None, :] >= cut[:, None, None], float("nan"))


def _definition(scores: torch.Tensor, kv_lens, sink, budget, recent):
    """Per request, the pick with ties to the earlier token (a stable sort, descending)."""
    total = sink + budget + recent
    rows = []
    for b, n in enumerate(kv_lens):
        if n <= total:
            rows.append(list(range(total)))
            continue
        middle = scores[b].float().amax(0)[sink:n - recent]
        top = (middle.sort(descending=True, stable=True).indices[:budget] + sink).sort().values
        rows.append(list(range(sink)) + top.tolist() + list(range(n - recent, n)))
    return rows


def _case_id(c):
    lens, h, L, sink, budget, recent = c
    return f"b{len(lens)}-h{h}-L{L}-s{sink}b{budget}r{recent}"


@pytest.mark.parametrize("knobs", list(KNOBS))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_distinct_scores_pick_what_the_torch_path_picks(case, knobs):
    lens, H, L, sink, budget, recent = case
    gen = torch.Generator().manual_seed(len(lens) * 31 + L)
    values = torch.randn(len(lens), H, L, generator=gen)
    scores = _scores(values, lens, recent).to(DEVICE)
    kv_lens = torch.tensor(lens, device=DEVICE)
    idx, counts = omnikv_select_triton(scores, kv_lens, sink, budget, recent, **KNOBS[knobs])
    want_idx, want_counts = pick_tokens(values.amax(1), torch.tensor(lens), sink, budget, recent)
    assert idx.dtype == torch.int64 and counts.dtype == torch.int32
    assert torch.equal(counts.cpu(), want_counts)
    assert torch.equal(idx.cpu(), want_idx), f"{knobs}: {(idx.cpu() != want_idx).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("knobs", list(KNOBS))
def test_ties_go_to_the_earlier_token(knobs):
    """Scores of 3 values: most of the budget is ties, and `torch.topk` may pick any of them."""
    lens, sink, budget, recent = [400, 257, 90, 30], 8, 40, 16
    gen = torch.Generator().manual_seed(11)
    values = torch.randint(0, 3, (len(lens), 2, 400), generator=gen).float() - 1.0
    values[1, :, 100] = 0.0
    values[1, 1, 100] = -0.0  # -0.0 ties with +0.0
    scores = _scores(values, lens, recent).to(DEVICE)
    idx, counts = omnikv_select_triton(scores, torch.tensor(lens, device=DEVICE), sink, budget, recent,
                                       **KNOBS[knobs])
    assert counts.tolist() == [min(n, sink + budget + recent) for n in lens]
    assert idx.cpu().tolist() == _definition(values, lens, sink, budget, recent)


@pytest.mark.parametrize("knobs", list(KNOBS))
def test_a_gap_right_below_the_budget_th_score(knobs):
    """Exactly `budget` middle scores in [1, 2), every other one negative: the budget-th
    largest key is the smallest of its leading byte, the edge of the first radix pass."""
    values, lens, sink, budget, recent = gap_case()
    scores = _scores(values, lens, recent).to(DEVICE)
    idx, _ = omnikv_select_triton(scores, torch.tensor(lens, device=DEVICE), sink, budget, recent, **KNOBS[knobs])
    assert idx.cpu().tolist() == _definition(values, lens, sink, budget, recent)


def gap_case():
    """(values, lens, sink, budget, recent): exactly `budget` middle scores in [1, 2) a request,
    every other one negative."""
    lens, sink, budget, recent = [300, 301], 4, 24, 8
    gen = torch.Generator().manual_seed(13)
    values = -torch.rand(2, 1, 301, generator=gen)
    for b, n in enumerate(lens):
        pos = sink + torch.randperm(n - sink - recent, generator=gen)[:budget]
        values[b, 0, pos] = 1.0 + torch.rand(budget, generator=gen)
    return values, lens, sink, budget, recent


@pytest.mark.parametrize("low", [8, 10, 16, 21, 24])
def test_keys_that_differ_only_below_a_digit(low):
    """Positive scores whose keys share every bit from `low` up (floats order as their bits),
    so the passes above settle nothing between them: the threshold is decided by the bytes
    at and below `low` (8, 16 and 24 a byte's edge, 10 and 21 inside one), with repeated
    keys among them (ties to the earlier token)."""
    lens, sink, budget, recent = [700, 650], 4, 60, 8
    gen = torch.Generator().manual_seed(low * 3)
    base = torch.tensor(1.5).view(torch.int32) & ~((1 << low) - 1)
    low_bits = torch.randint(0, 1 << low, (2, 1, 700), generator=gen, dtype=torch.int32)
    low_bits[:, :, 1::7] = low_bits[:, :, 2::7][..., : low_bits[:, :, 1::7].shape[-1]]  # repeats
    values = (base | low_bits).view(torch.float32)
    scores = _scores(values, lens, recent).to(DEVICE)
    idx, _ = omnikv_select_triton(scores, torch.tensor(lens, device=DEVICE), sink, budget, recent, block=64)
    assert idx.cpu().tolist() == _definition(values, lens, sink, budget, recent)


@pytest.mark.parametrize("case, block", [(CASES[0], 16), (CASES[3], 1024)], ids=["block16", "block1024"])
def test_pool_rows_of_the_pick(case, block):
    """With a page table the pick also gives each chosen token's pool row (its page's
    number times the page size plus its offset), -1 past a request's count, beside the
    tokens and counts of the torch path; with many blocks a request and with one, and a
    width within the total (every request takes all it has). A table that does not match
    the batch is refused."""
    lens, H, L, sink, budget, recent = case
    gen = torch.Generator().manual_seed(len(lens) * 7 + L)
    values = torch.randn(len(lens), H, L, generator=gen)
    scores = _scores(values, lens, recent).to(DEVICE)
    kv_lens = torch.tensor(lens, device=DEVICE)
    for ps, width in ((16, L), (4, sink + budget + recent)):
        pages = -(-width // ps)
        table = torch.stack([torch.randperm(len(lens) * pages, generator=gen)[:pages] for _ in lens]).int()
        idx, counts, rows = omnikv_select_triton(scores[..., :width], kv_lens, sink, budget, recent, block=block,
                                                 page_table=table.to(DEVICE), page_size=ps)
        want_idx, want_counts = pick_tokens(values[..., :width].amax(1), torch.tensor(lens), sink, budget, recent)
        assert torch.equal(idx.cpu(), want_idx) and torch.equal(counts.cpu(), want_counts)
        counted = torch.arange(want_idx.shape[1])[None, :] < want_counts[:, None]
        tok = torch.where(counted, want_idx, 0)
        want = torch.where(counted, table.long().gather(1, tok // ps) * ps + tok % ps, -1)
        assert rows.dtype == torch.int32 and torch.equal(rows.cpu().long(), want), (ps, width)
    with pytest.raises(ValueError, match="page_table must be"):
        omnikv_select_triton(scores, kv_lens, sink, budget, recent, page_table=table[:1].to(DEVICE), page_size=16)


def test_2d_scores_and_a_width_within_the_total():
    gen = torch.Generator().manual_seed(2)
    lens = [100, 33]
    values = torch.randn(2, 120, generator=gen)
    kv_lens = torch.tensor(lens, device=DEVICE)
    idx, counts = omnikv_select_triton(values.to(DEVICE), kv_lens, 4, 10, 6)
    want = pick_tokens(values, torch.tensor(lens), 4, 10, 6)
    assert torch.equal(idx.cpu(), want[0]) and torch.equal(counts.cpu(), want[1])
    idx, counts = omnikv_select_triton(values.to(DEVICE), kv_lens, 4, 0, 6)  # no budget: sink and recent only
    assert torch.equal(idx.cpu(), pick_tokens(values, torch.tensor(lens), 4, 0, 6)[0])
    idx, counts = omnikv_select_triton(values[:, :20].to(DEVICE), kv_lens, 4, 10, 6)  # width 20 = total
    assert idx.cpu().tolist() == [list(range(20))] * 2 and counts.tolist() == [20, 20]


def test_bad_inputs_are_refused():
    scores = torch.zeros(2, 2, 64, device=DEVICE)
    lens = torch.tensor([40, 3], device=DEVICE)
    with pytest.raises(ValueError, match="scores must be a floating"):
        omnikv_select_triton(scores[0, 0], lens, 4, 8, 4)
    with pytest.raises(ValueError, match="scores must be a floating"):
        omnikv_select_triton(scores.long(), lens, 4, 8, 4)
    with pytest.raises(ValueError, match="kv_lens must be an integer"):
        omnikv_select_triton(scores, lens.float(), 4, 8, 4)
    with pytest.raises(ValueError, match="budget"):
        omnikv_select_triton(scores, lens, 4, -1, 4)
    with pytest.raises(ValueError, match="block must be a power of two"):
        omnikv_select_triton(scores, lens, 4, 8, 4, block=48)
    with pytest.raises(ValueError, match="block must be an integer >= 16"):
        omnikv_select_triton(scores, lens, 4, 8, 4, block=8)


@pytest.mark.gpu
def test_the_128k_benchmark_shape_on_the_gpu():
    """B=6 requests near 128K in a 133120-token table, 8 KV heads, 1472 of ~130K middle tokens."""
    lens = [131072 + 1, 131072 + 40, 120000, 131072 + 7, 3000, 131072 + 1]
    gen = torch.Generator(device="cuda").manual_seed(7)
    values = torch.randn(6, 8, 133120, generator=gen, device="cuda")
    kv_lens = torch.tensor(lens, device="cuda")
    idx, counts = omnikv_select_triton(_scores(values.cpu(), lens, 512).cuda(), kv_lens, 64, 1472, 512)
    want_idx, want_counts = pick_tokens(values.amax(1), kv_lens, 64, 1472, 512)
    assert torch.equal(counts, want_counts) and torch.equal(idx, want_idx)
