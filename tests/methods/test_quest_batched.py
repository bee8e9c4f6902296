"""Quest's batched path (page-bound pool, one top-k for every request, page selections) is
the per-request definition of ``methods/selection.py``.

- ``update_page_minmax_torch`` == ``update_page_minmax_ref`` (prefill chunk over pages, a
  chunk starting mid-page, decode slots, -1 padding); ``quest_page_scores_torch`` ==
  ``quest_page_scores_ref``.
- Driven through the runtime's ``select`` with a CUDA-graph-shaped context (``seqs =
  [None] * B``, dummy host lengths): per (request, KV head) the selected pages are
  ``quest_select_pages(quest_page_bounds(q_b, quest_page_minmax(K_b)))``, ties aside,
  for lengths below, at and past the total, several budgets and GQA groupings, with a
  width fixed by the config and the page-table width.
- The engine (torch provider, CPU) generates the tokens of the former per-request path
  (reproduced here), mixed prefill + decode steps included; with a covering budget,
  vanilla's. Synthesised prefill fills the bounds; a mismatched page size is an error.
- The Triton provider's page-mode sparse decode (interpreted on a CPU) == the torch one.
"""

from __future__ import annotations

import types

import pytest
import torch

from sparseengine import LLM, SamplingParams
from sparseengine.attention.provider import make_provider
from sparseengine.attention.torch_ref import TorchAttentionProvider
from sparseengine.config import Config, ConfigError
from sparseengine.engine.step_context import LayerView, Selection, StepContext
from sparseengine.kernels import paged_kv_write_ref, quest_page_scores_ref, update_page_minmax_ref
from sparseengine.kernels.quest import update_page_minmax_torch
from sparseengine.kernels.quest_scores import quest_page_scores_torch
from sparseengine.kernels.testing import random_paged_kv, randn
from sparseengine.methods import quest
from sparseengine.methods.base import MethodStack, SparseMethodRuntime
from sparseengine.methods.selection import (pages_to_tokens, quest_page_bounds, quest_page_minmax,
                                            quest_select_pages)

SCORE_RTOL = 1e-5  # "ties aside": bounds this close (relative to the largest) may swap
NUM_LAYERS = 3


def nan_like_meta(kv) -> torch.Tensor:
    n, _, hkv, d = kv.k_cache.shape
    return torch.full((n, hkv, d), float("nan"))


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)


def test_torch_minmax_update_equals_reference():
    gen = torch.Generator().manual_seed(1)
    ps, lens = 4, [11, 6, 3]
    kv = random_paged_kv(lens, 2, 8, ps, generator=gen, spare_pages=2)
    metas = {name: (nan_like_meta(kv), nan_like_meta(kv)) for name in ("ref", "torch")}

    def both(slots, what):
        slots = torch.tensor(slots) if isinstance(slots, list) else slots
        update_page_minmax_ref(kv.k_cache, slots, *metas["ref"])
        update_page_minmax_torch(kv.k_cache, slots, *metas["torch"])
        for i, side in enumerate(("max", "min")):
            assert_same(metas["torch"][i], metas["ref"][i], f"{what}: {side}")

    s0, s1, s2 = kv.slots(0), kv.slots(1), kv.slots(2)
    both(torch.cat([s0[:5], torch.tensor([-1]), s1[:2]]), "prefill chunks over pages, padding")
    both(torch.cat([s0[5:9], s1[2:5], torch.tensor([-1, -1])]), "chunks starting mid-page")
    both(torch.cat([s2, torch.tensor([-1])]), "a whole short request")
    new_k = randn(2, 2, 8, generator=gen)  # decode: fresh values at each request's next slot
    paged_kv_write_ref(new_k, new_k, kv.k_cache, kv.v_cache, torch.stack([s0[9], s1[5]]))
    both(torch.stack([s0[9], s1[5]]), "decode slots")
    both([-1, -1], "padding only")
    for b, n in enumerate(lens[:2]):  # written in order: the bounds of the written prefix
        written = 10 if b == 0 else 6
        k = kv.dense(b)[0][:written]
        pages = kv.page_table[b, : -(-written // ps)].long()
        hi, lo = quest_page_minmax(k, ps)
        assert torch.equal(metas["torch"][0][pages], hi) and torch.equal(metas["torch"][1][pages], lo)


def test_torch_page_scores_equal_reference():
    gen = torch.Generator().manual_seed(2)
    kv = random_paged_kv([5, 40, 17], 2, 16, 4, generator=gen, extra_cols=3)
    hi, lo = nan_like_meta(kv), nan_like_meta(kv)
    update_page_minmax_ref(kv.k_cache, torch.cat([kv.slots(b) for b in range(3)]), hi, lo)
    q = randn(3, 8, 16, generator=gen)
    args = (q, hi, lo, kv.page_table, kv.kv_lens, 4)
    want = quest_page_scores_ref(*args)
    got = quest_page_scores_torch(*args)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- batched selection


def runtime(hkv: int, ps: int, sink: int, budget: int, recent: int, skip: int = 1) -> quest.Quest:
    cfg = Config.from_kwargs(sparse_method="quest", page_size=ps, quest_page_size=ps, quest_skip_layers=skip,
                             sink_tokens=sink, budget=budget, recent_tokens=recent)
    model = types.SimpleNamespace(name="tiny", num_layers=NUM_LAYERS, num_kv_heads=hkv)
    return quest.Quest(cfg, model, cache=None)


def graph_context(rt, kv, slots: torch.Tensor, provider: str = "torch") -> StepContext:
    """What a CUDA-graph capture hands the method: no host requests, dummy host lengths."""
    B = kv.kv_lens.shape[0]
    view = LayerView(slots, kv.kv_lens, (1,) * B, kv.page_table)
    cache = types.SimpleNamespace(layer=lambda layer: (kv.k_cache, kv.v_cache))
    return StepContext(seqs=[None] * B, q_lens=(1,) * B, cu_q_lens=torch.arange(B + 1, dtype=torch.int32),
                       is_decode=True, views=[view] * NUM_LAYERS, kv_cache=cache,
                       provider=make_provider(provider, kv.k_cache.device), method=rt,
                       positions=torch.zeros(B, dtype=torch.long))


def assert_same_pages(got: list[int], want: list[int], bounds: torch.Tensor, where: str) -> None:
    """``got == want`` as sets, or another top-k of ``bounds`` within float tolerance."""
    g, w = set(got), set(want)
    assert len(g) == len(got) == len(want), f"{where}: {got} vs {want}"
    if g == w:
        return
    scale = float(bounds.abs().max())
    assert float(bounds[sorted(g - w)].min()) >= float(bounds[sorted(w - g)].max()) - SCORE_RTOL * scale, (
        f"{where}: chose {sorted(g - w)} over {sorted(w - g)}")


# (Hq, Hkv, page, sink, budget, recent, lengths): below, at, one past, far past the total
CASES = [
    (4, 4, 4, 4, 16, 8, [1, 27, 28, 29, 97]),
    (4, 2, 8, 2, 16, 20, [37, 38, 39, 101, 150]),  # budget // page = 2 -> 3 pages
    (8, 2, 4, 5, 12, 6, [22, 23, 24, 61]),  # sink and recent straddle pages
    (8, 2, 8, 4, 8, 0, [12, 13, 61, 64]),  # no recent tokens: a partial last page competes
    (4, 1, 4, 0, 20, 3, [23, 24, 70]),  # no sink
    (4, 2, 16, 12, 56, 0, [66, 68, 69, 120]),  # within the total: more pages than sink + top
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}q{c[1]}kv-p{c[2]}-s{c[3]}b{c[4]}r{c[5]}")
def test_batched_pages_are_the_per_request_definition(case):
    hq, hkv, ps, sink, budget, recent, lens = case
    gen = torch.Generator().manual_seed(sum(lens) + budget)
    kv = random_paged_kv(lens, hkv, 16, ps, generator=gen, extra_cols=2)
    q = randn(len(lens), hq, 16, generator=gen)
    rt = runtime(hkv, ps, sink, budget, recent)
    all_slots = torch.cat([kv.slots(b) for b in range(len(lens))])
    assert rt.select(0, q, graph_context(rt, kv, all_slots)) is None  # skipped layer: dense
    sel = rt.select(1, q, graph_context(rt, kv, all_slots))  # writes the bounds of every page, selects
    B, P = len(lens), kv.page_table.shape[1]
    width = min(quest.selection_width(ps, sink, budget, recent), P)
    assert sel.page_size == ps and sel.dense == (False,) * B
    assert tuple(sel.token_indices.shape) == (B, hkv, width) and tuple(sel.num_selected.shape) == (B, hkv)
    for b, n in enumerate(lens):
        hi, lo = quest_page_minmax(kv.dense(b)[0], ps)
        bounds = quest_page_bounds(q[b], hi, lo)
        want = quest_select_pages(bounds, n, ps, sink, recent, budget)
        for h in range(hkv):
            count = int(sel.num_selected[b, h])
            got = sel.token_indices[b, h, :count]
            where = f"request {b} (n={n}) head {h}"
            assert got.tolist() == sorted(got.tolist()), f"{where}: not ascending"
            assert_same_pages(got.tolist(), want[h].tolist(), bounds[h], where)
            assert (sel.token_indices[b, h, count:] == -1).all()


@pytest.mark.parametrize("ps,sink,budget,recent", [(4, 4, 16, 8), (8, 3, 5, 1), (16, 12, 56, 0), (16, 64, 64, 17)])
def test_selection_width_bounds_every_length(ps, sink, budget, recent):
    width = quest.selection_width(ps, sink, budget, recent)
    most = 0
    for n in range(1, sink + budget + recent + 8 * ps):
        bounds = torch.zeros(1, -(-n // ps))
        most = max(most, quest_select_pages(bounds, n, ps, sink, recent, budget).shape[1])
    assert most == width


def test_page_size_mismatch_names_both():
    cfg = Config.from_kwargs(sparse_method="quest", page_size=8)  # quest_page_size: 16 by default
    with pytest.raises(ConfigError, match=r"quest_page_size=16.*page_size=8"):
        quest.Quest(cfg, types.SimpleNamespace(num_layers=2, num_kv_heads=2), cache=None)


def test_quest_is_graph_capturable_alone_and_stacked():
    rt = runtime(2, 4, 2, 8, 4)
    assert rt.graph_capturable() and rt.wants_forward_hooks([])
    dense = SparseMethodRuntime(rt.config, rt.model, None)
    assert not dense.graph_capturable()
    assert MethodStack(dense, rt).graph_capturable()  # a hook-free part does not block the graph

    class Hooked(SparseMethodRuntime):
        def select(self, layer, q, ctx):
            return None

    assert not MethodStack(Hooked(rt.config, rt.model, None), rt).graph_capturable()


# ------------------------------------------------------------------------------ engine


def per_request_select(self, layer, q, ctx):
    """The former Quest path: per decoding request, bounds from its gathered K, the
    reference page choice, a token selection."""
    if layer < self.skip or not any(s.is_decoding for s in ctx.seqs):
        return None
    cfg, chosen, counts, start = self.config, [], [], 0
    for seq, n in zip(ctx.seqs, ctx.q_lens):
        length = seq.layer_lens[layer] + n
        if not seq.is_decoding or length <= self.total:
            chosen.append(None)
            counts.append(None)
        else:
            hi, lo = quest_page_minmax(self.cache.gather(seq, layer, length)[0].float(), self.page)
            bounds = quest_page_bounds(q[start + n - 1], hi, lo)
            pages = quest_select_pages(bounds, length, self.page, cfg.sink_tokens, cfg.recent_tokens, cfg.budget)
            tokens, valid = pages_to_tokens(pages, self.page, length)
            chosen.append(tokens)
            counts.append(valid.sum(-1))
        start += n
    if all(c is None for c in chosen):
        return None
    return Selection.from_lists(chosen, self.model.num_kv_heads, q.device, counts)


ENGINE = dict(dtype="float32", device="cpu", page_size=8, quest_page_size=8, kv_cache_memory=0.01,
              attention_provider="torch", quest_skip_layers=1)


def test_engine_tokens_equal_the_per_request_path_and_vanilla_when_covered(tiny_llama):
    folder, hf = tiny_llama
    gen = torch.Generator().manual_seed(11)
    # total 28: prompts below, at and past it; chunks of 24 mix prefill with decode steps
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 28, 45, 70)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sparse = dict(ENGINE, sparse_method="quest", sink_tokens=4, budget=16, recent_tokens=8,
                  prefill_chunk_size=24, max_num_batched_tokens=32)
    outs, mixed = {}, []
    for name in ("batched", "per_request"):
        with LLM(str(folder), **sparse) as llm:
            rt = llm.method
            chosen = types.MethodType(per_request_select, rt) if name == "per_request" else rt.select

            def select(layer, q, ctx, chosen=chosen):
                sel = chosen(layer, q, ctx)
                if name == "batched" and sel is not None and not ctx.is_decode:
                    mixed.append(sel.dense)
                return sel

            rt.select = select
            outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
    assert any(True in d and False in d for d in mixed)  # some steps mixed prefill and decode rows
    assert outs["batched"] == outs["per_request"]
    covering = dict(ENGINE, sink_tokens=4, budget=80 - 12, recent_tokens=8)
    for method in ("vanilla", "quest"):
        with LLM(str(folder), sparse_method=method, **covering) as llm:
            outs[method] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["quest"] == outs["vanilla"]


def test_synthesized_prefill_fills_the_page_bounds(tiny_llama):
    folder, _ = tiny_llama
    with LLM(str(folder), sparse_method="quest", sink_tokens=2, budget=8, recent_tokens=4, **ENGINE) as llm:
        rt, checked = llm.method, []
        fill = rt.init_synthetic

        def check(seq):  # right after the synthesised prefill, before any decode step
            fill(seq)
            for layer in range(rt.skip, llm.model_config.num_layers):
                hi, lo = quest_page_minmax(llm.cache.gather(seq, layer)[0], 8)
                pages = torch.tensor(seq.page_table[: hi.shape[0]])
                kmax, kmin = rt._bounds[layer]
                assert torch.equal(kmax[pages], hi) and torch.equal(kmin[pages], lo), layer
                checked.append(layer)

        rt.init_synthetic = check
        llm.generate([list(range(3, 40))], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                     prefill="synthesized")
    assert checked == list(range(1, llm.model_config.num_layers))


# ------------------------------------------------------------------ triton provider


def test_triton_page_decode_equals_torch_provider():
    pytest.importorskip("triton")
    from sparseengine.attention.triton_provider import TritonAttentionProvider

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: tests/conftest sets TRITON_INTERPRET=1
    gen = torch.Generator().manual_seed(7)
    ps, lens, hq, hkv = 4, [3, 22, 41], 8, 2
    kv = random_paged_kv(lens, hkv, 16, ps, generator=gen, extra_cols=1, device=device)
    q = randn(len(lens), hq, 16, generator=gen, device=device)
    slots = torch.cat([kv.slots(b) for b in range(len(lens))])
    outs = {}
    for name, provider in (("torch", TorchAttentionProvider()), ("triton", TritonAttentionProvider())):
        rt = runtime(hkv, ps, sink=2, budget=8, recent=5)  # fresh bounds: each provider's update fills them
        ctx = graph_context(rt, kv, slots, provider=name)
        ctx.views = [LayerView(slots, kv.kv_lens, tuple(lens), kv.page_table)] * NUM_LAYERS  # host lens: torch
        sel = rt.select(1, q, ctx)
        assert int(sel.num_selected[2].max()) < -(-lens[2] // ps)  # really sparse
        outs[name], _ = provider.attend(q, kv.k_cache, kv.v_cache, ctx, ctx.views[1], sel, None)
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fold", [False, True])
def test_triton_selection_takes_the_same_pages_with_maxima_from_the_scores(monkeypatch, fold):
    """The decode step's shortlist from group maxima the page scores' launch took
    (`quest_select.MAXIMA_FROM_SCORES`) chooses exactly the pages it chose reading the scores
    in groups itself; with the step's keys folded into the bounds in that launch too."""
    pytest.importorskip("triton")
    from sparseengine.kernels import quest_select

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: tests/conftest sets TRITON_INTERPRET=1
    gen = torch.Generator().manual_seed(11)
    ps, lens, hq, hkv = 4, [3, 22, 41, 64], 8, 2
    kv = random_paged_kv(lens, hkv, 16, ps, generator=gen, extra_cols=1, device=device)
    q = randn(len(lens), hq, 16, generator=gen, device=device)
    newest = torch.tensor([int(kv.slots(b)[-1]) for b in range(len(lens))], device=device)  # each request's last token
    every = torch.cat([kv.slots(b) for b in range(len(lens))])
    assert quest_select.maxima_group(kv.page_table.shape[1], ps, 8, 64) == 2  # the path runs here
    picks = {}
    for on in (True, False):
        monkeypatch.setattr(quest_select, "MAXIMA_FROM_SCORES", on)
        rt = runtime(hkv, ps, sink=2, budget=8, recent=5)
        sel = rt.select(1, q, graph_context(rt, kv, every, provider="triton"))  # the bounds' update, then scores
        if fold:  # a decode step: the newest keys fold into the bounds in the scores' launch
            sel = rt.select(1, q, graph_context(rt, kv, newest, provider="triton"))
        n = sel.num_selected
        picks[on] = [sel.token_indices[b, h, : int(n[b, h])].tolist() for b in range(len(lens)) for h in range(hkv)]
    assert picks[True] == picks[False]
    assert max(len(p) for p in picks[True]) < -(-lens[3] // ps)  # a real choice among middle pages


def test_the_record_names_the_choice_kernel(tiny_llama):
    """`kernels(device, provider)` names what chooses Quest's pages (the records'
    `engine/method_kernels`): on a CPU the provider's kernel (torch; the interpreted Triton
    provider's Triton kernel), also under a prefill method (a MethodStack); a method with no
    op of its own names none."""
    with LLM(str(tiny_llama[0]), device="cpu", sparse_method="quest", num_kv_pages=64) as llm:
        assert llm.method.kernels(llm.device, llm.provider) == {"quest_select": "torch"}
        triton = make_provider("triton", torch.device("cpu"))  # interpreted here
        assert llm.method.kernels(llm.device, triton) == {"quest_select": "triton"}
    with LLM(str(tiny_llama[0]), device="cpu", sparse_method="quest", prefill_sparse_method="flashprefill_v2",
             flashprefill_threshold=0.002, num_kv_pages=64) as llm:
        assert isinstance(llm.method, MethodStack)
        assert llm.method.kernels(llm.device, llm.provider) == {"quest_select": "torch"}
    with LLM(str(tiny_llama[0]), device="cpu", sparse_method="vanilla", num_kv_pages=64) as llm:
        assert llm.method.kernels(llm.device, llm.provider) == {}
