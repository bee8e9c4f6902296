"""H2O's score accumulation into the per-slot pools: the vectorised torch and the Triton
versions against the plain loop, on fresh random inputs (shuffled pages, a CUDA-graph
padding row of length 0, rows that are all new tokens, a width past every row)."""

from __future__ import annotations

import pytest
import torch

from sparseengine import kernels
from sparseengine.kernels.h2o_scores import h2o_scores_accumulate_torch

from .conftest import DEVICE

PAGES, PAGE, HKV = 24, 4, 3


def inputs(gen, lens, news, width):
    B = len(lens)
    scores = torch.rand(PAGES, PAGE, HKV, generator=gen)
    positions = torch.randint(0, 1000, (PAGES, PAGE, HKV), generator=gen, dtype=torch.int32)
    colsum = torch.rand(B, HKV, width, generator=gen)
    per_row = -(-width // PAGE)
    table = torch.randperm(PAGES, generator=gen)[: B * per_row].view(B, per_row).to(torch.int32)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    first = torch.tensor([n - q for n, q in zip(lens, news)], dtype=torch.int32)
    pos0 = torch.randint(0, 5000, (B,), generator=gen)
    return scores, positions, colsum, table, kv_lens, first, pos0


@pytest.mark.parametrize("lens,news,width", [
    ([7, 1, 13], [1, 1, 1], 16),  # decode: one new token per row
    ([9, 0, 5], [1, 1, 1], 12),  # row 1: graph padding (length 0) writes nothing
    ([16, 6], [16, 2], 16),  # a prefill chunk: a row of only new tokens
])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_accumulate_matches_plain_loop(gen, lens, news, width, impl):
    args = inputs(gen, lens, news, width)
    want_s, want_p = args[0].clone(), args[1].clone()
    kernels.h2o_scores_accumulate_ref(want_s, want_p, *args[2:])
    got_s, got_p = args[0].clone().to(DEVICE), args[1].clone().to(DEVICE)
    rest = [t.to(DEVICE) for t in args[2:]]
    fn = h2o_scores_accumulate_torch if impl == "torch" else kernels.h2o_scores_accumulate_triton
    fn(got_s, got_p, *rest)
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=1e-6, atol=1e-7)
    assert torch.equal(got_p.cpu(), want_p)
    assert not torch.equal(want_s, args[0])  # the step changed something


def test_accumulate_rejects_bad_pools(gen):
    scores, positions, colsum, table, lens, first, pos0 = inputs(gen, [5], [1], 8)
    with pytest.raises(ValueError, match="float32 and positions int32"):
        kernels.h2o_scores_accumulate_ref(scores.double(), positions, colsum, table, lens, first, pos0)
    with pytest.raises(ValueError, match="colsum"):
        kernels.h2o_scores_accumulate_triton(scores, positions, colsum[:, :2], table, lens, first, pos0)
