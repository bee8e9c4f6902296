"""End to end: on a real forward pass the engine keeps / selects what METHODS.md defines.

An independent reference runs the same token ids through the Hugging Face twin's own
modules (input layer norm, q/k/v projections, Qwen3 q/k norms, HF's rotary embedding,
o_proj, MLP) and keeps, per (layer, KV head), the list of logical tokens its cache holds.
Each method's rule is written straight from METHODS.md with plain loops (in
``selection_reference.py``); nothing is imported from ``sparseengine.methods``. Its dense prefill is checked against
HF's own ``output_hidden_states`` first, so its Q/K/V are HF's.

The engine is driven step by step (``llm.step()``) on random tiny models of four GQA
groupings (Hq/Hkv = 4/4, 4/2, 6/2 Qwen3, 8/2). After every step:
- its cached K and V rows per (layer, KV head) must be the reference's rows: the same
  tokens, in the same (logical) order, with the same values (eviction methods: what was
  kept; rerotate: keys re-rotated to their cache index);
- quest / omnikv: every selection the runtime returns (recorded by a spy that calls the
  real ``llm.method.select``) must be the reference's selection for the decode query;
- the sampled token must be the reference's greedy token.
Ties aside: where the engine's choice differs from the reference's, it must still be a
valid top-k under the reference's scores within float tolerance; the reference then
continues from the engine's choice.

Covered: streamingllm (both position modes, chunked prefill), snapkv and pyramidkv
(prefill scoring, both poolings, chunked windows, clipped / fallback pyramids, optional
decode eviction), h2o (prefill and every-step / interval decode eviction), quest, omnikv
(logits / probs, one or several filter layers), including two edge cases that once
exposed engine bugs (a prompt within the SnapKV window; Quest with no recent tokens).
(``test_covering_budget.py``: with a budget covering prompt and output, every method
generates vanilla's tokens.) Observed engine-vs-reference differences are ~4e-6 (ATOL is
2e-4).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from sparseengine import LLM, SamplingParams
from sparseengine.engine.sequence import Sequence
from sparseengine.models.loader import SHAPES_DIR
from tests.methods.selection_reference import (REF, Reference, RefMethod, RefOmniKV, RefPyramidKV, RefQuest,
                                               tie_ok)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/methods/conftest.py

ATOL = 2e-4  # engine (float32, own kernels) vs reference rows

# ----------------------------------------------------------------------------- models

# name -> (shipped base shape, Hq, Hkv)
SHAPES = {
    "g1": ("tiny-llama", 4, 4),
    "g2": ("tiny-llama", 4, 2),  # the shipped tiny-llama (llama3 rope scaling)
    "g3": ("tiny-qwen3", 6, 2),  # the shipped tiny-qwen3 (q/k norms)
    "g4": ("tiny-llama", 8, 2),
}
_MODELS: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """model(name) -> (folder, hf twin), built once per module."""

    def get(name):
        if name not in _MODELS:
            base, hq, hkv = SHAPES[name]
            cfg = json.loads((SHAPES_DIR / f"{base}.json").read_text())
            cfg.update(num_attention_heads=hq, num_key_value_heads=hkv)
            config_cls, model_cls = {
                "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
            }[cfg["model_type"]]
            torch.manual_seed(100 + len(_MODELS))
            hf = model_cls(config_cls(**cfg)).eval()
            with torch.no_grad():  # as tests/conftest.py: large enough that attention is peaked
                for pname, p in hf.named_parameters():
                    if "norm" in pname:
                        p.uniform_(0.8, 1.2)
                    else:
                        p.normal_(0, 0.1)
            folder = tmp_path_factory.mktemp(f"sel-{name}")
            hf.save_pretrained(folder)
            _MODELS[name] = (folder, hf)
        return _MODELS[name]

    yield get
    _MODELS.clear()


def prompt(n: int, seed: int) -> list[int]:
    """Distinct random token ids (vocab 512): no two prompt tokens share a layer-0 key."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(509, generator=g)[:n] + 3).tolist()


# ------------------------------------------------------------------------------ harness


def identify(ref: Reference, layer: int, head: int, rows: torch.Tensor) -> list[int]:
    """The logical token each engine key row holds (nearest reference key, within ATOL)."""
    ids = []
    for i, row in enumerate(rows):
        if ref.rerotate:
            pre = torch.stack([ref.k_pre[layer][t][head] for t in range(ref.n)])
            cand = ref.rope(pre[:, None], [i] * ref.n)[:, 0]
        else:
            cand = torch.stack([ref.k_rot[layer][t][head] for t in range(ref.n)])
        dist = (cand - row).abs().amax(dim=1)
        best = int(dist.argmin())
        assert float(dist[best]) < ATOL * 10, (
            f"layer {layer} head {head}: engine cache row {i} is no token's key (nearest {best}, "
            f"max abs diff {float(dist[best]):.2e})")
        ids.append(best)
    return ids


def check_cache(llm, seq, ref: Reference, plan: dict, where: str, ordered: bool = True) -> None:
    """Engine K/V rows of every (layer, KV head) == the reference cache's rows. ``ordered``:
    the engine must hold them in token order; otherwise (StreamingLLM's ring, H2O) any slot order,
    compared after sorting the engine's rows into token order."""
    for layer in range(ref.L):
        K, V = llm.cache.gather(seq, layer)
        for head in range(ref.hkv):
            want = ref.keys(layer, head)
            k_rows, v_rows = K[:, head], V[:, head]
            if not (K.shape[0] == want.shape[0] and torch.allclose(k_rows, want, atol=ATOL, rtol=1e-4)):
                got = identify(ref, layer, head, k_rows)
                if not ordered:  # read the engine's rows in token order
                    perm = sorted(range(len(got)), key=got.__getitem__)
                    got, k_rows, v_rows = [got[i] for i in perm], k_rows[perm], v_rows[perm]
                choice = plan.get((layer, head))
                assert got == ref.cache[layer][head] or (choice is not None and tie_ok(got, choice)), (
                    f"{where}: layer {layer} KV head {head}: engine keeps {got}, reference keeps "
                    f"{ref.cache[layer][head]}")
                assert got == sorted(got), f"{where}: layer {layer} head {head}: cache not in token order"
                ref.cache[layer][head] = got  # ties aside: continue from the engine's choice
                want = ref.keys(layer, head)
                assert torch.allclose(k_rows, want, atol=ATOL, rtol=1e-4), where
            assert torch.allclose(v_rows, ref.values(layer, head), atol=ATOL, rtol=1e-4), (
                f"{where}: layer {layer} head {head}: V rows differ")


def engine_sets(sel, hkv: int, n: int) -> list[list[int]] | None:
    """The logical tokens each KV head reads (a page selection read as its tokens below n)."""
    if sel is None or sel.dense[0]:
        return None
    tokens, valid = sel.request_tokens(0, n)
    return [sorted(tokens[h][valid[h]].tolist()) for h in range(hkv)]


def make_select(ref: Reference, method: RefMethod, calls: dict, where: str):
    """The reference's selection for each decode layer, checked against the engine's."""

    def select(layer, q):
        choices = method.choose(ref, layer, q)
        n = len(ref.cache[layer][0])
        got = engine_sets(calls.get(layer), ref.hkv, n)
        if choices is None:
            assert got is None or all(g == list(range(n)) for g in got), (
                f"{where}: layer {layer} must read densely, engine selected {got}")
            return None
        assert got is not None, f"{where}: layer {layer}: engine read densely, reference selects"
        allowed = []
        for head, choice in enumerate(choices):
            if isinstance(method, RefQuest):
                pages = sorted({t // method.knobs.get("quest_page_size", 16) for t in got[head]})
                assert got[head] == method.tokens(ref, layer, pages), (
                    f"{where}: layer {layer} head {head}: selection is not whole pages: {got[head]}")
                ok = tie_ok(pages, choice)
                want = method.tokens(ref, layer, choice.kept)
            else:
                ok = tie_ok(got[head], choice)
                want = choice.kept
            assert ok, (f"{where}: layer {layer} KV head {head}: engine selects {got[head]}, "
                        f"reference selects {want}")
            if isinstance(method, RefOmniKV) and sorted(got[head]) != choice.kept:
                choice.kept = sorted(got[head])  # ties aside: shared from here on
            allowed.append(set(got[head]))
        return allowed

    return select


def run_engine_vs_reference(model, name, method, ids, *, sink, budget, recent, decode_steps,
                            chunk=2048, ordered=True, provider="auto", **knobs):
    folder, hf = model(name)
    rerotate = bool(knobs.get("streamingllm_rerotate", False))
    ref = Reference(hf, rerotate=rerotate)
    rule = REF[method](sink, budget, recent, **knobs)
    llm = LLM(str(folder), dtype="float32", device="cpu", sparse_method=method, sink_tokens=sink,
              budget=budget, recent_tokens=recent, kv_cache_memory=0.01,
              page_size=knobs.get("quest_page_size", 16) if method == "quest" else 8,  # quest pages = cache pages
              prefill_chunk_size=chunk, attention_provider=provider, **knobs)
    calls: dict[int, object] = {}
    real_select = llm.method.select

    def spy(layer, q, ctx):  # records what the real runtime returns, returns it unchanged
        sel = real_select(layer, q, ctx)
        calls[layer] = sel
        return sel

    llm.method.select = spy
    try:
        seq = Sequence(list(ids), SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True),
                       ref.L)
        llm.scheduler.add(seq)
        done_decodes, step = 0, 0
        while done_decodes < decode_steps:
            before, decoding = seq.num_computed_tokens, seq.is_decoding
            calls.clear()
            llm.step()
            fed = seq.all_token_ids[before: seq.num_computed_tokens]
            where = f"{method} {name} n={len(ids)} step {step} ({'decode' if decoding else 'prefill'})"
            select = make_select(ref, rule, calls, where) if rule.selects and decoding else None
            logits = ref.step(fed, select)
            if step == 0 and before == 0:  # the reference's dense prefill is HF's
                with torch.no_grad():
                    hs = hf(torch.tensor([fed]), output_hidden_states=True).hidden_states
                for layer in range(ref.L):
                    assert torch.allclose(ref.layer_inputs[layer], hs[layer][0], atol=1e-5), layer
            prefill_ended = not decoding and seq.num_computed_tokens == len(ids)
            plan = rule.finish(ref, prefill_ended, decoding)
            check_cache(llm, seq, ref, plan, where, ordered)
            if seq.num_computed_tokens == seq.num_tokens - 1:  # this step sampled a token
                assert int(logits.argmax()) == seq.output_token_ids[-1], f"{where}: sampled token differs"
            done_decodes += decoding
            step += 1
        return seq, ref
    finally:
        llm.close()


# -------------------------------------------------------------------------------- tests

STREAMING = [  # name, n, sink, recent, rerotate, chunk, decode steps
    ("g2", 45, 4, 16, False, 2048, 4),
    ("g3", 70, 2, 24, True, 2048, 4),
    ("g1", 37, 4, 8, False, 16, 3),  # chunked: eviction between prompt chunks
    ("g4", 28, 4, 24, True, 2048, 3),  # prompt == total: the first decode step evicts
    ("g2", 53, 4, 12, True, 20, 3),
    ("g3", 33, 0, 10, False, 2048, 2),  # no sink
    ("g2", 30, 2, 6, False, 2048, 9),  # the recent ring wraps around
]


@pytest.mark.parametrize("name,n,sink,recent,rerotate,chunk,steps", STREAMING)
def test_streamingllm_keeps_sink_and_recent(model, name, n, sink, recent, rerotate, chunk, steps):
    seq, ref = run_engine_vs_reference(model, name, "streamingllm", prompt(n, seed=n), sink=sink,
                                       budget=0, recent=recent, decode_steps=steps, chunk=chunk,
                                       streamingllm_rerotate=rerotate, ordered=rerotate)
    assert seq.layer_lens == [min(seq.num_computed_tokens, sink + recent)] * ref.L


SNAPKV = [  # name, n, sink, budget, recent, knobs, chunk
    ("g2", 77, 4, 16, 8, dict(snapkv_window=8), 2048),
    ("g3", 101, 2, 24, 16, dict(snapkv_kernel=5, snapkv_pooling="avg"), 2048),  # default window 32
    ("g1", 59, 4, 20, 8, dict(snapkv_window=8), 13),  # the window straddles prompt chunks
    ("g4", 83, 0, 30, 4, dict(snapkv_window=6, snapkv_kernel=3), 2048),
    ("g4", 42, 4, 32, 8, dict(snapkv_window=8), 2048),  # n <= total: exact
]


@pytest.mark.parametrize("name,n,sink,budget,recent,knobs,chunk", SNAPKV)
def test_snapkv_keeps_reference_tokens(model, name, n, sink, budget, recent, knobs, chunk):
    seq, ref = run_engine_vs_reference(model, name, "snapkv", prompt(n, seed=n + 1), sink=sink,
                                       budget=budget, recent=recent, decode_steps=2, chunk=chunk, **knobs)
    tail = max(recent, knobs.get("snapkv_window", 32))
    expect = n if n <= sink + budget + recent else sink + budget + tail
    assert seq.layer_lens == [expect + 2] * ref.L


PYRAMID = [  # name, n, sink, budget, recent, knobs; per-layer budgets in the comment
    ("g2", 97, 4, 30, 8, dict(snapkv_window=8, pyramidkv_beta=10.0)),  # 57, 39, 21, 3
    ("g3", 62, 2, 30, 8, dict(snapkv_window=8, pyramidkv_beta=10.0)),  # clipped: 54, 38, 22, 6
    ("g4", 55, 4, 30, 8, dict(snapkv_window=8)),  # n < 2B: uniform snapkv
    ("g1", 130, 4, 24, 8, dict(snapkv_pooling="avg")),  # window 32, beta 20: 47, 32, 16, 1
]


@pytest.mark.parametrize("name,n,sink,budget,recent,knobs", PYRAMID)
def test_pyramidkv_keeps_reference_tokens(model, name, n, sink, budget, recent, knobs):
    seq, ref = run_engine_vs_reference(model, name, "pyramidkv", prompt(n, seed=n + 2), sink=sink,
                                       budget=budget, recent=recent, decode_steps=2, **knobs)
    window = knobs.get("snapkv_window", 32)
    budgets = RefPyramidKV(sink, budget, recent, **knobs).layer_budgets(ref.L, n, window)
    tail = max(recent, window)
    assert seq.layer_lens == [min(n, sink + b + tail) + 2 for b in budgets]


H2O = [  # name, n, sink, budget, recent, chunk, decode steps, knobs
    ("g2", 50, 4, 12, 8, 2048, 5, {}),
    ("g3", 75, 2, 20, 10, 32, 4, {}),  # chunked prefill: scores accumulate over chunks
    ("g1", 30, 4, 10, 14, 2048, 4, {}),
    ("g4", 26, 4, 16, 8, 2048, 5, {}),  # n < total: decode steps grow the row past it
    ("g2", 49, 4, 12, 8, 2049, 6, dict(h2o_decode_interval=3)),
    ("g3", 12, 2, 6, 2, 2048, 14, {}),  # short prompt, many decode steps: decode rows decide
    ("g2", 50, 4, 12, 8, 2048, 4, dict(provider="triton")),  # its kernels (interpreted on CPU)
    ("g3", 12, 2, 6, 2, 2048, 9, dict(provider="triton")),
]


@pytest.mark.parametrize("name,n,sink,budget,recent,chunk,steps,knobs", H2O)
def test_h2o_keeps_heavy_hitters(model, name, n, sink, budget, recent, chunk, steps, knobs):
    seq, ref = run_engine_vs_reference(model, name, "h2o", prompt(n, seed=n + 3), sink=sink,
                                       budget=budget, recent=recent, decode_steps=steps, chunk=chunk,
                                       ordered=False, **knobs)  # evictions refill freed slots
    assert max(seq.layer_lens) <= sink + budget + recent + knobs.get("h2o_decode_interval", 1) - 1


DECODE_EVICTION = [  # method, name, n, sink, budget, recent, knobs, decode steps
    ("snapkv", "g2", 60, 2, 10, 4, dict(snapkv_window=4, snapkv_decode_interval=6, snapkv_kernel=3), 13),
    ("pyramidkv", "g3", 70, 2, 12, 4,  # layer budgets 21, 15, 9, 3
     dict(snapkv_window=4, snapkv_decode_interval=5, pyramidkv_beta=4.0), 11),
]


@pytest.mark.parametrize("method,name,n,sink,budget,recent,knobs,steps", DECODE_EVICTION)
def test_snapkv_decode_eviction_rescores_with_decode_queries(model, method, name, n, sink, budget, recent,
                                                             knobs, steps):
    seq, ref = run_engine_vs_reference(model, name, method, prompt(n, seed=n + 6), sink=sink, budget=budget,
                                       recent=recent, decode_steps=steps, snapkv_decode_eviction=True, **knobs)
    rule = REF[method](sink, budget, recent, **knobs)
    budgets = rule.layer_budgets(ref.L, n, knobs["snapkv_window"])
    since = steps % knobs["snapkv_decode_interval"]
    assert seq.layer_lens == [sink + b + max(recent, knobs["snapkv_window"]) + since for b in budgets]


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv"])
def test_snapkv_prompt_shorter_than_window_is_kept_whole(model, method):
    seq, ref = run_engine_vs_reference(model, "g2", method, prompt(20, seed=5), sink=2, budget=4, recent=4,
                                       decode_steps=2)
    assert seq.layer_lens == [22] * ref.L


QUEST = [  # name, n, sink, budget, recent, knobs
    ("g2", 70, 4, 16, 8, dict(quest_page_size=8)),
    ("g3", 101, 2, 16, 20, dict(quest_skip_layers=1)),  # page 16: budget // page = 1 -> 3 pages
    ("g4", 61, 5, 12, 6, dict(quest_page_size=4, quest_skip_layers=0)),
    ("g1", 45, 4, 24, 8, dict(quest_page_size=8, quest_skip_layers=1)),
    # its kernels (interpreted on CPU): decode steps fold their keys into the bounds as they score
    ("g4", 61, 5, 12, 6, dict(quest_page_size=4, quest_skip_layers=0, provider="triton")),
]


@pytest.mark.parametrize("name,n,sink,budget,recent,knobs", QUEST)
def test_quest_selects_reference_pages(model, name, n, sink, budget, recent, knobs):
    run_engine_vs_reference(model, name, "quest", prompt(n, seed=n + 4), sink=sink, budget=budget,
                            recent=recent, decode_steps=3, **knobs)


@pytest.mark.parametrize("provider", ["auto", "triton"])
def test_quest_without_recent_tokens_selects_whole_valid_pages(model, provider):
    """No recent window: the page each decode step writes is scored too (on the Triton
    provider with the step's key folded in by the scoring kernel)."""
    run_engine_vs_reference(model, "g4", "quest", prompt(61, seed=1), sink=4, budget=8, recent=0,
                            decode_steps=6, quest_page_size=8, quest_skip_layers=0, provider=provider)


OMNIKV = [  # name, n, sink, budget, recent, knobs
    ("g2", 60, 4, 12, 8, dict(omnikv_filter_layers="1")),
    ("g3", 90, 2, 20, 6, dict(omnikv_filter_layers="0,2", omnikv_score="probs")),
    ("g4", 47, 4, 8, 4, dict(omnikv_filter_layers="1,2")),
    ("g1", 39, 4, 10, 5, dict(omnikv_filter_layers="2", omnikv_score="probs")),
]


@pytest.mark.parametrize("name,n,sink,budget,recent,knobs", OMNIKV)
def test_omnikv_selects_reference_tokens(model, name, n, sink, budget, recent, knobs):
    run_engine_vs_reference(model, name, "omnikv", prompt(n, seed=n + 5), sink=sink, budget=budget,
                            recent=recent, decode_steps=3, **knobs)
