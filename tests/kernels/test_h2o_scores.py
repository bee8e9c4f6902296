"""H2O's per-slot scores: the accumulation into the pools (vectorised torch and Triton
against the plain loop, on fresh random inputs: shuffled pages, a CUDA-graph padding row
of length 0, rows that are all new tokens, a width past every row), and the eviction's
pick (the Triton kernel against the plain loop and ``h2o.h2o_victims``, which in
turn equals what ``h2o_keep`` drops)."""

from __future__ import annotations

import pytest
import torch

from sparseengine import kernels
from sparseengine.kernels.h2o_scores import h2o_scores_accumulate_torch
from sparseengine.methods.h2o import h2o_victims
from sparseengine.methods.selection import h2o_keep

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


@pytest.mark.parametrize("n,sink,recent,ties", [(21, 2, 4, False), (37, 0, 5, True), (9, 3, 1, True)])
def test_victim_kernel_matches_plain_loop_and_definition(gen, n, sink, recent, ties):
    """Two requests, rows whose slots hold scattered positions in random order, two of the
    three layers: the Triton pick, the plain loop and ``h2o.h2o_victims`` agree."""
    layers_n, G = 3, 2
    scores = torch.rand(layers_n, PAGES, PAGE, HKV, generator=gen)
    if ties:
        scores = (scores * 3).floor() / 3  # few distinct values
    positions = torch.full((layers_n, PAGES, PAGE, HKV), -7, dtype=torch.int32)
    per = -(-n // PAGE)
    table = torch.randperm(PAGES, generator=gen)[: G * per].view(G, per)
    T = torch.tensor([5 * n, 3 * n])
    for g in range(G):
        for layer in range(layers_n):
            for h in range(HKV):
                mid = sink + torch.randperm(int(T[g]) - recent - sink, generator=gen)[: n - sink - recent]
                pos = torch.cat([torch.arange(sink), mid, torch.arange(int(T[g]) - recent, int(T[g]))])
                pos = pos[torch.randperm(n, generator=gen)]  # slot order is free
                for j in range(n):
                    positions[layer, table[g, j // PAGE], j % PAGE, h] = int(pos[j])
    layers = torch.tensor([2, 0])
    want = kernels.h2o_victim_ref(scores, positions, table, layers, T, n, sink, recent)
    got = kernels.h2o_victim_triton(*(t.to(DEVICE) for t in (scores, positions, table, layers, T)), n, sink, recent)
    assert torch.equal(got.cpu(), want)
    idx = torch.arange(n)
    slots = table[:, idx // PAGE] * PAGE + idx % PAGE  # [G, n]
    s = scores.view(layers_n, -1, HKV)[layers][:, slots].permute(1, 0, 3, 2)  # [G, nl, Hkv, n]
    p = positions.view(layers_n, -1, HKV)[layers][:, slots].permute(1, 0, 3, 2)
    definition = h2o_victims(s, p, T[:, None, None].expand(s.shape[:-1]), sink, recent, 1)[..., 0]
    assert torch.equal(definition, want)


@pytest.mark.parametrize("n,sink,budget,recent,ties", [(100, 4, 20, 16, False), (40, 0, 10, 5, True),
                                                        (37, 4, 28, 4, True), (50, 3, 1, 0, False)])
def test_h2o_victims_in_any_slot_order_are_what_keep_drops(n, sink, budget, recent, ties):
    """``h2o.h2o_victims`` (the pick the kernel above is checked against) on rows
    whose slots hold their tokens in a random order, at scattered positions (the sink and
    the last ``recent`` positions present): the victims are exactly the tokens ``h2o_keep``
    drops from the same row in token order, ties included."""
    hkv, T = 3, 4 * n
    gen = torch.Generator().manual_seed(n + budget)
    middle = sink + torch.randperm(T - recent - sink, generator=gen)[: n - sink - recent].sort().values
    pos = torch.cat([torch.arange(sink), middle, torch.arange(T - recent, T)])  # token order
    acc = torch.randn(hkv, n, generator=gen).abs()  # accumulated probabilities: >= 0
    if ties:
        acc = (acc * 2).floor()  # a handful of distinct values: many ties
    keep = h2o_keep(acc, sink, budget, recent)
    perm = torch.stack([torch.randperm(n, generator=gen) for _ in range(hkv)])  # slot -> token index
    victims = h2o_victims(acc.gather(1, perm), pos[perm], torch.full((hkv,), T), sink, recent,
                          n - keep.shape[1])
    for h in range(hkv):
        dropped = sorted(perm[h, victims[h]].tolist())
        assert dropped == sorted(set(range(n)) - set(keep[h].tolist())), h
