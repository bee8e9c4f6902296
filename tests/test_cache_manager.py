"""The cache manager's compaction and token moves against plain indexing on random
caches; StreamingLLM's ring order."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sparseengine.engine.cache_manager import CacheManager
from sparseengine.engine.kv_cache import KVCache
from sparseengine.engine.sequence import Sequence
from sparseengine.methods.streamingllm import token_order
from sparseengine.sampling_params import SamplingParams

LAYERS, PAGES, PAGE, HKV, D = 3, 12, 4, 2, 5


def make_cache(seed: int) -> CacheManager:
    shape = SimpleNamespace(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D)  # the pool alone, no model
    kv = KVCache(shape, PAGES, PAGE, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(LAYERS, PAGES, PAGE, HKV, D, generator=g))
    kv.v.copy_(torch.randn(LAYERS, PAGES, PAGE, HKV, D, generator=g))
    return CacheManager(kv, scheduler=None)


def make_seq(n: int, pages: list[int]) -> Sequence:
    seq = Sequence(list(range(n)), SamplingParams(temperature=0, max_tokens=1), num_layers=LAYERS)
    seq.page_table = list(pages)
    seq.layer_lens = [n] * LAYERS
    return seq


def compacted(cache: torch.Tensor, pages: list[int], keep: dict[int, torch.Tensor]) -> torch.Tensor:
    """Plain reference: in each layer of ``keep`` ({layer: [Hkv, count]}), head h's i-th
    slot receives the token at cache index ``keep[layer][h, i]``, read before any write."""
    out = cache.clone()
    for layer, kept in keep.items():
        for h in range(HKV):
            for i, j in enumerate(kept[h].tolist()):
                out[layer, pages[i // PAGE], i % PAGE, h] = cache[layer, pages[j // PAGE], j % PAGE, h]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_compact_layers_against_plain_indexing(seed):
    rng = random.Random(seed)
    n, count = 14, 9
    pages = rng.sample(range(PAGES), 4)
    keep = torch.stack([torch.stack([torch.tensor(sorted(rng.sample(range(n), count))) for _ in range(HKV)])
                        for _ in range(LAYERS)])  # [L, Hkv, count], a different set per layer and head
    c, seq = make_cache(seed), make_seq(n, pages)
    want_k, want_v = (compacted(t, pages, dict(enumerate(keep))) for t in (c.kv.k, c.kv.v))
    c.compact_layers(seq, keep)
    assert seq.layer_lens == [count] * LAYERS
    assert torch.equal(c.kv.k, want_k) and torch.equal(c.kv.v, want_v)


def test_compact_one_layer_and_a_subset_of_layers():
    n, pages = 11, [5, 2, 9]
    keep = torch.tensor([[0, 1, 7, 8, 10], [0, 2, 3, 8, 10]])
    c, seq = make_cache(7), make_seq(n, pages)
    want_k = compacted(c.kv.k, pages, {0: keep, 2: keep})
    c.compact_layers(seq, keep, layers=[0, 2])
    assert seq.layer_lens == [5, n, 5] and torch.equal(c.kv.k, want_k)
    c, seq = make_cache(7), make_seq(n, pages)
    c.compact(seq, 1, keep)
    assert seq.layer_lens == [n, 5, n] and torch.equal(c.kv.k, compacted(make_cache(7).kv.k, pages, {1: keep}))
    with pytest.raises(ValueError, match="keep must be"):
        c.compact_layers(seq, torch.zeros(3, 4, dtype=torch.long))


@pytest.mark.parametrize("start,tail", [(3, 6), (0, 4), (5, 0)])
def test_compact_tokens_keeps_the_front_and_moves_the_kept_rows_behind_it(start, tail):
    """The tokens below ``start`` stay, ``keep`` follows them in every head (sources and
    destinations overlap: every source is read first), token pools alike, other layers
    untouched: what ``compact_layers`` does with the front kept in place."""
    n, pages = 14, [6, 1, 4, 8]
    keep = torch.arange(n - tail, n)
    full = torch.cat([torch.arange(start), keep]).expand(HKV, -1)
    c, seq = make_cache(11), make_seq(n, pages)
    pool = c.token_pool("p", torch.float32)
    pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(2)))
    want_k, want_v, want_pool = (compacted(t, pages, {0: full, 2: full}) for t in (c.kv.k, c.kv.v, pool[..., None]))
    c.compact_tokens(seq, keep, [0, 2], start)
    assert seq.layer_lens == [start + tail, n, start + tail]
    assert torch.equal(c.kv.k, want_k) and torch.equal(c.kv.v, want_v) and torch.equal(pool, want_pool[..., 0])


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



def test_token_pools_travel_with_compaction_and_moves():
    c, seq = make_cache(5), make_seq(10, [3, 7, 1])
    pool = c.token_pool("p", torch.float32)
    assert pool.shape == (LAYERS, PAGES, PAGE, HKV) and c.token_pool("p", torch.float32) is pool
    pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(1)))
    keep = torch.tensor([[0, 2, 5, 9], [1, 2, 3, 8]])
    # K rows are unique random vectors: the pool must end where its token's K row ends
    src_k, src_pool = c.kv.k.clone(), pool.clone()
    c.compact_layers(seq, keep)
    want = compacted(src_pool[..., None], seq.page_table, {l: keep for l in range(LAYERS)})[..., 0]
    assert torch.equal(pool, want) and torch.equal(c.kv.k, compacted(src_k, seq.page_table,
                                                                     {l: keep for l in range(LAYERS)}))
    before = pool.clone()
    c.move_tokens(torch.tensor([5, 17]), torch.tensor([8, 2]))
    flat = before.view(LAYERS, PAGES * PAGE, HKV).clone()
    flat[:, [8, 2]] = flat[:, [5, 17]]
    assert torch.equal(pool.view(LAYERS, PAGES * PAGE, HKV), flat)


@pytest.mark.parametrize("seed,total,k", [(0, 9, 1), (1, 9, 3), (2, 4, 7), (3, 6, 2)])
def test_evict_to_refills_freed_slots_with_the_kept_tail(seed, total, k):
    """Two requests, two of the three layers, distinct victims per (request, layer, head):
    after ``evict_to`` each row holds its kept tokens at indices [0, total), the kept ones
    past the total moved into the freed indices in order; other layers and the pool agree."""
    rng = random.Random(seed)
    n, layers = total + k, [2, 0]
    per = -(-n // PAGE)
    pages = rng.sample(range(PAGES), 2 * per)
    tables = [pages[:per], pages[per:]]  # two requests own disjoint pages
    c = make_cache(seed)
    pool = c.token_pool("score", torch.float32)
    pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(pool.shape))  # a distinct tag per entry
    victims = torch.tensor([[[rng.sample(range(n), k) for _ in range(HKV)] for _ in layers] for _ in tables])
    k_before, pool_before = c.kv.k.clone(), pool.clone()
    c.evict_to(torch.tensor(tables), layers, victims, total)
    for g, pages in enumerate(tables):
        for li, layer in enumerate(layers):
            for h in range(HKV):
                gone = set(victims[g, li, h].tolist())
                freed = sorted(v for v in gone if v < total)
                tail = [i for i in range(total, n) if i not in gone]
                row = list(range(total))  # cache index -> the index its token came from
                for f, t in zip(freed, tail, strict=True):
                    row[f] = t
                at = lambda i: (pages[i // PAGE], i % PAGE)  # noqa: E731
                for i, j in enumerate(row):
                    assert torch.equal(c.kv.k[(layer, *at(i), h)], k_before[(layer, *at(j), h)])
                    assert pool[(layer, *at(i), h)] == pool_before[(layer, *at(j), h)]
    assert torch.equal(c.kv.k[1], k_before[1])  # a layer not named


def test_a_tiered_pool_moves_rows_per_layer_and_pages_to_the_wide_tier():
    """Layer 1 narrow (pages 0..4 only): its rows sit at their own offsets in the token
    rows, so moves in every layer match plain per-layer indexing; move_to_wide carries the
    wide layers' pages past the bound to the wide tier and leaves the narrow layer alone."""
    from sparseengine.engine.page_allocator import PageAllocator
    from sparseengine.engine.scheduler import Scheduler, SchedulerConfig

    shape = SimpleNamespace(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D)
    kv = KVCache(shape, PAGES, PAGE, torch.float32, torch.device("cpu"), narrow_layers=(1,), narrow_pages=5)
    g = torch.Generator().manual_seed(3)
    kv.k_rows.copy_(torch.randn(kv.k_rows.shape, generator=g))
    kv.v_rows.copy_(torch.randn(kv.v_rows.shape, generator=g))
    assert [kv.layer(layer)[0].shape[0] for layer in range(LAYERS)] == [PAGES, 5, PAGES]
    alloc = PageAllocator(PAGES, narrow_pages=5)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=64,
                                      page_size=PAGE, max_model_len=64), alloc)
    c = CacheManager(kv, sched)
    before = [tuple(t.clone() for t in kv.layer(layer)) for layer in range(LAYERS)]
    c.move_tokens(torch.tensor([3, 17]), torch.tensor([9, 1]))  # slots in pages 0..4: valid in every layer
    for layer in range(LAYERS):
        for got, old in zip(kv.layer(layer), before[layer]):
            want = old.flatten(0, 1).clone()
            want[[9, 1]] = old.flatten(0, 1)[[3, 17]]
            assert torch.equal(got.flatten(0, 1), want)
    seq = make_seq(4 * PAGE, alloc.allocate(4))  # pages 0..3, all narrow
    before = [tuple(t.clone() for t in kv.layer(layer)) for layer in range(LAYERS)]
    assert c.move_to_wide(seq, 1) == 3
    assert seq.page_table[0] == 0 and all(not alloc.is_narrow(p) for p in seq.page_table[1:])
    assert alloc.num_free_narrow == 4 and alloc.num_used == 4
    for layer in (0, 2):
        for got, old in zip(kv.layer(layer), before[layer]):
            for i, page in enumerate(seq.page_table):
                assert torch.equal(got[page], old[i])  # page i held i: every logical page's rows followed it
    assert all(torch.equal(got, old) for got, old in zip(kv.layer(1), before[1]))
    with pytest.raises(ValueError, match="no token pools"):
        c.token_pool("p", torch.float32)
