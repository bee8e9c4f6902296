"""`deltakv_layout.map_chosen` against the layout's definition, entry by entry."""
import pytest
import torch

from sparseengine.methods.deltakv_layout import map_chosen


def expected(tokens, count, hist_end, pages, sink, budget, ps):
    """One row, by the definition: sink tokens in place; history tokens (sink <= t <
    hist_end) into the scratch slots sink, sink + 1, ... in order, rebuilt at the cache slot
    of that index; raw tail tokens at sink + budget + (t - hist_end); an uncompressed row
    (hist_end -1) in place. Positions clamped into [sink, hist_end - 1]."""
    idx, slots, pos, nxt = [], [], [], sink
    for j, t in enumerate(tokens):
        hist = hist_end >= 0 and j < count and sink <= t < hist_end
        if hist_end < 0:
            idx.append(t)
        elif t >= hist_end:
            idx.append(sink + budget + t - hist_end)
        elif hist:
            idx.append(nxt)
        else:
            idx.append(t)
        slots.append(pages[nxt // ps] * ps + nxt % ps if hist else -1)
        nxt += hist
        pos.append(min(max(t, sink), max(hist_end - 1, sink)))
    return idx, slots, pos


@pytest.mark.parametrize("sink,budget,ps", [(2, 4, 4), (4, 8, 2)])
def test_map_chosen_matches_the_layout(sink, budget, ps):
    gen = torch.Generator().manual_seed(0)
    rows = [  # (tokens ascending, count, hist_end)
        ([0, 1, 3, 5, 9, 12, 13], 7, 10),   # sink, history, raw tail
        ([0, 2, 6, 7, 20, 21, 22], 5, 8),   # the last two past the count
        ([1, 3, 4, 5, 6, 7, 8], 7, -1),     # not compressed: in place
        ([0, 1, 2, 3, 15, 16, 17], 7, 15),  # no history token chosen past the sink
        ([0, 5, 6, 7, 9, 10, 11], 2, 12),   # history-range entries past the count: not rebuilt
    ]
    K = len(rows[0][0])
    tokens = torch.tensor([r[0] for r in rows])
    counts = torch.tensor([r[1] for r in rows])
    hist_end = torch.tensor([[r[2]] for r in rows])
    table = torch.stack([torch.randperm(50, generator=gen)[:12] for _ in rows])
    idx, slots, pos = map_chosen(tokens, counts, hist_end, table, sink, budget, ps)
    assert idx.shape == slots.shape == pos.shape == (len(rows), K)
    for b, (toks, count, end) in enumerate(rows):
        want = expected(toks, count, end, table[b].tolist(), sink, budget, ps)
        assert (idx[b].tolist(), slots[b].tolist(), pos[b].tolist()) == want, b
