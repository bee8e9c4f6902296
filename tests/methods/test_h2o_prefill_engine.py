"""h2o_prefill in the engine against a plain reference written from METHODS.md (and the
choices its runtime file fixes): the kept sets after every prompt chunk, alone and paired
with h2o (whose evictions refill freed slots), and a prompt longer than the KV pool.

The reference loops over heads, rows and tokens in float64 and imports nothing it checks.
"""

from __future__ import annotations

import pytest
import torch

from sparseengine import LLM, SamplingParams
from sparseengine.engine.cache_manager import CacheManager
from sparseengine.kernels.fused_ops import rotary_qk
from sparseengine.layers.attention import Attention
from tests.methods.prefill_common import ENGINE, GREEDY, prompt_ids, ref_softmax_row

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/methods/conftest.py



def ref_h2o_prefill(events, prompt_len, hkv, g, d, sink, recent, budget, window, decode_total=None):
    """Replays the engine's q/k (by position), its compactions and its evictions; after every
    chunk the engine's cache (as original positions, per layer and KV head) must equal this
    reference's kept list. ``decode_total``: paired with h2o (scores from every row), which
    evicts to that total at prefill end and after every decode step, refilling freed slots
    (so from its first eviction on the rows are compared as sets). Returns the number of
    comparisons."""
    keys: dict[int, dict[int, torch.Tensor]] = {}
    kept: dict[int, list[list[int]]] = {}
    score: dict[int, list[dict[int, float]]] = {}
    engine: dict[int, list[list[int]]] = {}
    nxt: dict[int, int] = {}
    checks = 0
    unordered = False
    for ev in events:
        if ev[0] == "evict":  # CacheManager.evict_to: kept tokens past the total refill freed slots
            _, layer, victims, total = ev
            unordered = True
            for h, row in enumerate(engine[layer]):
                gone = set(victims[h].tolist())
                freed = sorted(v for v in gone if v < total)
                tail = [i for i in range(total, len(row)) if i not in gone]
                new = row[:total]
                for f, t in zip(freed, tail, strict=True):
                    new[f] = row[t]
                engine[layer][h] = new
            continue
        if ev[0] == "compact":
            _, layer, keep = ev
            engine[layer] = [[engine[layer][h][i] for i in keep[h].tolist()] for h in range(hkv)]
            continue
        _, layer, q, k = ev
        kept.setdefault(layer, [[] for _ in range(hkv)])
        engine.setdefault(layer, [[] for _ in range(hkv)])
        score.setdefault(layer, [{} for _ in range(hkv)])
        keys.setdefault(layer, {})
        got = [sorted(r) for r in engine[layer]] if unordered else engine[layer]
        assert got == kept[layer], f"layer {layer} before position {nxt.get(layer, 0)}"
        checks += 1
        start = nxt.get(layer, 0)
        n = q.shape[0]
        nxt[layer] = start + n
        for i in range(n):
            keys[layer][start + i] = k[i]
            for h in range(hkv):
                kept[layer][h].append(start + i)
                engine[layer][h].append(start + i)
        if start >= prompt_len and decode_total is None:  # decode: vanilla keeps what prefill left
            continue
        rows = n if window == 0 or decode_total is not None else min(window, n)
        totals = [budget] if start + n < prompt_len else [budget, decode_total]
        if start >= prompt_len:
            totals = [decode_total]
        for h in range(hkv):
            for i in range(n - rows, n):
                p = start + i
                cand = [t for t in kept[layer][h] if t <= p]
                kmat = torch.stack([keys[layer][t][h] for t in cand])
                for qh in range(h * g, (h + 1) * g):
                    probs = ref_softmax_row(q[i, qh], kmat, d)
                    for t, pr in zip(cand, probs.tolist()):
                        score[layer][h][t] = score[layer][h].get(t, 0.0) + pr / g
            for total in totals:
                ks = kept[layer][h]
                if total is not None and len(ks) > total:
                    middle = ks[sink: len(ks) - recent]
                    top = sorted(range(len(middle)), key=lambda j: (-score[layer][h][middle[j]], j))
                    kept[layer][h] = ks[:sink] + [middle[j] for j in sorted(top[: total - sink - recent])] + \
                        ks[len(ks) - recent:]
    return checks


@pytest.mark.parametrize("window,decode", [(8, "vanilla"), (0, "vanilla"), (8, "h2o")])
def test_h2o_prefill_kept_sets_match_reference(tiny_llama, monkeypatch, window, decode):
    folder, _ = tiny_llama
    events = []
    forward, compact_layers, evict_to = Attention.forward, CacheManager.compact_layers, CacheManager.evict_to

    def spy_forward(self, q, k, v, cos, sin):
        qr, kr = rotary_qk(q, k, cos, sin)  # what the layer attends with (it rotates them)
        events.append(("attn", self.layer_id, qr.clone(), kr.clone()))
        return forward(self, q, k, v, cos, sin)

    def spy_compact_layers(self, seq, keep, layers=None):  # every compaction; recorded layer by layer
        layers = range(len(seq.layer_lens)) if layers is None else layers
        per_layer = keep if keep.dim() == 3 else keep.expand(len(layers), *keep.shape)
        for layer, k in zip(layers, per_layer):
            events.append(("compact", layer, k.clone()))
        return compact_layers(self, seq, keep, layers)

    def spy_evict_to(self, table, layers, victims, total):  # h2o's evictions, layer by layer
        assert victims.shape[0] == 1  # one request
        for layer, v in zip(layers, victims[0]):
            events.append(("evict", layer, v.clone(), total))
        return evict_to(self, table, layers, victims, total)

    monkeypatch.setattr(Attention, "forward", spy_forward)
    monkeypatch.setattr(CacheManager, "compact_layers", spy_compact_layers)
    monkeypatch.setattr(CacheManager, "evict_to", spy_evict_to)
    sink, recent, budget = 4, 8, 40
    h2o_budget = 20  # h2o pairing: its total 32 < 40
    extra = {"budget": h2o_budget} if decode == "h2o" else {}
    llm = LLM(str(folder), **ENGINE, prefill_chunk_size=32, sink_tokens=sink, recent_tokens=recent,
              sparse_method=decode, prefill_sparse_method="h2o_prefill", h2o_prefill_budget=budget,
              h2o_prefill_window=window, **extra)
    mc = llm.model_config
    prompt = prompt_ids(150, seed=3)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert any(e[0] == "compact" for e in events)
    checks = ref_h2o_prefill(events, len(prompt), mc.num_kv_heads, mc.num_heads // mc.num_kv_heads, mc.head_dim,
                             sink, recent, budget, window, sink + h2o_budget + recent if decode == "h2o" else None)
    assert checks == mc.num_layers * (5 + 2)  # 5 chunks and 2 decode steps, every layer
    assert out.metrics["kv_tokens"] == (sink + h2o_budget + recent if decode == "h2o" else budget + 2)
    llm.close()


@pytest.mark.parametrize("decode", ["vanilla", "h2o"])
def test_h2o_prefill_prompt_longer_than_pool(tiny_llama, decode):
    folder, _ = tiny_llama
    pool = dict(ENGINE, num_kv_pages=12, prefill_chunk_size=32, sink_tokens=4, recent_tokens=8)  # 96 slots
    prompt = prompt_ids(400, seed=5)
    with LLM(str(folder), **pool) as dense:
        out = dense.generate(prompt, GREEDY)[0]
        assert out.finish_reason == "error" and "KV pages" in out.error
    extra = {"budget": 20} if decode == "h2o" else {}
    with LLM(str(folder), **pool, sparse_method=decode, prefill_sparse_method="h2o_prefill",
             h2o_prefill_budget=48, h2o_prefill_window=16, **extra) as llm:
        assert llm.method.cache_tokens_needed(len(prompt)) == 48 + 32
        outs = llm.generate([prompt, prompt_ids(300, seed=6)], GREEDY)
        for o in outs:
            assert o.finish_reason == "length" and len(o.token_ids) == GREEDY.max_tokens, o.error
            assert o.metrics["kv_tokens"] <= (32 if decode == "h2o" else 48 + GREEDY.max_tokens)
        assert llm.peak_pages_used <= 12
