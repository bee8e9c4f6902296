"""The cache manager's batched compaction and token moves against the per-layer
``compact`` and plain indexing, on random caches; StreamingLLM's ring order."""

from __future__ import annotations

import random

import pytest
import torch

from sparseengine.engine.cache_manager import CacheManager
from sparseengine.engine.kv_cache import KVCache
from sparseengine.engine.sequence import Sequence
from sparseengine.methods.streamingllm import token_order
from sparseengine.sampling_params import SamplingParams

LAYERS, PAGES, PAGE, HKV, D = 3, 12, 4, 2, 5


def make_cache(seed: int) -> CacheManager:
    kv = KVCache.__new__(KVCache)  # the pool alone: shapes chosen here, not by a model
    g = torch.Generator().manual_seed(seed)
    kv.k = torch.randn(LAYERS, PAGES, PAGE, HKV, D, generator=g)
    kv.v = torch.randn(LAYERS, PAGES, PAGE, HKV, D, generator=g)
    kv.num_pages, kv.page_size = PAGES, PAGE
    return CacheManager(kv, scheduler=None)


def make_seq(n: int, pages: list[int]) -> Sequence:
    seq = Sequence(list(range(n)), SamplingParams(temperature=0, max_tokens=1), num_layers=LAYERS)
    seq.page_table = list(pages)
    seq.layer_lens = [n] * LAYERS
    return seq


@pytest.mark.parametrize("seed", range(4))
def test_compact_layers_equals_compact_per_layer(seed):
    rng = random.Random(seed)
    n, count = 14, 9
    pages = rng.sample(range(PAGES), 4)
    keep = torch.stack([torch.stack([torch.tensor(sorted(rng.sample(range(n), count))) for _ in range(HKV)])
                        for _ in range(LAYERS)])  # [L, Hkv, count], a different set per layer and head
    a, b = make_cache(seed), make_cache(seed)
    sa, sb = make_seq(n, pages), make_seq(n, pages)
    for layer in range(LAYERS):
        a.compact(sa, layer, keep[layer])
    b.compact_layers(sb, keep)
    assert sa.layer_lens == sb.layer_lens == [count] * LAYERS
    assert torch.equal(a.kv.k, b.kv.k) and torch.equal(a.kv.v, b.kv.v)


def test_compact_layers_shared_keep_and_subset_of_layers():
    n, pages = 11, [5, 2, 9]
    keep = torch.tensor([[0, 1, 7, 8, 10], [0, 1, 7, 8, 10]])
    a, b = make_cache(7), make_cache(7)
    sa, sb = make_seq(n, pages), make_seq(n, pages)
    for layer in (0, 2):
        a.compact(sa, layer, keep)
    b.compact_layers(sb, keep, layers=[0, 2])
    assert sb.layer_lens == [5, n, 5] == sa.layer_lens
    assert torch.equal(a.kv.k, b.kv.k) and torch.equal(a.kv.v, b.kv.v)
    with pytest.raises(ValueError, match="keep must be"):
        b.compact_layers(sb, torch.zeros(3, 4, dtype=torch.long))


def test_move_tokens_copies_every_layer_and_head():
    c = make_cache(3)
    before_k, before_v = c.kv.k.clone(), c.kv.v.clone()
    src, dst = torch.tensor([5, 17, 40]), torch.tensor([8, 2, 33])
    c.move_tokens(src, dst)
    flat = lambda t: t.view(LAYERS, PAGES * PAGE, HKV, D)  # noqa: E731
    for t, before in ((c.kv.k, before_k), (c.kv.v, before_v)):
        want = flat(before).clone()
        want[:, dst] = flat(before)[:, src]
        assert torch.equal(flat(t), want)


@pytest.mark.parametrize("sink,recent,steps,extra", [(2, 5, 0, 3), (2, 5, 3, 1), (0, 4, 9, 2), (3, 1, 4, 2)])
def test_token_order_follows_the_ring(sink, recent, steps, extra):
    """Simulate the ring: after a compaction the cache holds tokens 0..total-1 in order;
    each step's newest token takes the oldest recent token's slot. token_order must list the
    slots of the remaining tokens plus ``extra`` new ones in token order."""
    total = sink + recent
    slots = list(range(total))  # slot -> token
    ring, t = 0, total
    for _ in range(steps):
        slots[sink + ring] = t
        ring, t = (ring + 1) % recent, t + 1
    slots += list(range(t, t + extra))
    order = token_order(total + extra, sink, recent, ring).tolist()
    tokens = [slots[i] for i in order]
    assert tokens == sorted(tokens) and sorted(order) == list(range(total + extra))

