"""End to end: on a real forward pass the engine keeps / selects what METHODS.md defines.

An independent reference runs the same token ids through the Hugging Face twin's own
modules (input layer norm, q/k/v projections, Qwen3 q/k norms, HF's rotary embedding,
o_proj, MLP) and keeps, per (layer, KV head), the list of logical tokens its cache holds.
Each method's rule is written here straight from METHODS.md with plain loops; nothing is
imported from ``sparseengine.methods``. Its dense prefill is checked against HF's own
``output_hidden_states`` first, so its Q/K/V are HF's.

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
exposed engine bugs (a prompt within the SnapKV window; Quest with no recent tokens). Last, with a budget covering prompt and output, every method generates vanilla's
tokens. Observed engine-vs-reference differences are ~4e-6 (ATOL is 2e-4).
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sparseengine import LLM, SamplingParams
from sparseengine.engine.sequence import Sequence
from sparseengine.models.loader import SHAPES_DIR

ATOL = 2e-4  # engine (float32, own kernels) vs reference rows
SCORE_RTOL = 1e-4  # "ties aside": scores this close (relative to the largest) may swap

# ----------------------------------------------------------------------------- models

# name -> (shipped base shape, Hq, Hkv)
SHAPES = {
    "g1": ("tiny-llama", 4, 4),
    "g2": ("tiny-llama", 4, 2),  # the shipped tiny-llama (llama3 rope scaling)
    "g3": ("tiny-qwen3", 6, 2),  # the shipped tiny-qwen3 (q/k norms)
    "g4": ("tiny-llama", 8, 2),
}
_MODELS: dict[str, tuple] = {}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster than two, and far faster on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


# -------------------------------------------------------------------------- reference


@dataclass
class Choice:
    """A reference decision for one (layer, KV head): ``kept`` (logical token ids, or page
    ids for quest) and ``ranked``: the score of every candidate the top-k ranked."""

    kept: list[int]
    ranked: dict[int, float] = field(default_factory=dict)


def top(scores: dict[int, float], count: int) -> list[int]:
    """The ``count`` best candidates, ties to the earlier one."""
    return sorted(scores, key=lambda j: (-scores[j], j))[:count]


def tie_ok(got: list[int], choice: Choice) -> bool:
    """True when ``got`` equals ``choice.kept`` or is another top-k of the same scores
    within float tolerance (ties aside)."""
    if sorted(got) == sorted(choice.kept):
        return True
    ranked = choice.ranked
    if len(got) != len(choice.kept) or len(set(got)) != len(got):
        return False
    if {j for j in got if j not in ranked} != {j for j in choice.kept if j not in ranked}:
        return False
    inside = [ranked[j] for j in got if j in ranked]
    outside = [s for j, s in ranked.items() if j not in set(got)]
    if not inside or not outside:
        return True
    scale = max(abs(s) for s in ranked.values()) or 1.0
    return min(inside) >= max(outside) - SCORE_RTOL * scale


class Reference:
    """A plain re-implementation of the model forward over per-(layer, KV head) caches of
    logical token ids, using the HF twin's modules."""

    def __init__(self, hf, rerotate: bool = False) -> None:
        self.hf = hf
        c = hf.config
        self.L, self.hq, self.hkv = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
        self.d = getattr(c, "head_dim", None) or c.hidden_size // self.hq
        self.g = self.hq // self.hkv
        self.rerotate = rerotate  # keys stored at their cache index (streamingllm_rerotate)
        self.n = 0  # tokens fed so far (logical)
        self.k_pre = [[] for _ in range(self.L)]  # [layer][token] -> [Hkv, d] before RoPE
        self.k_rot = [[] for _ in range(self.L)]  # rotated at the position the token was fed at
        self.v = [[] for _ in range(self.L)]
        self.q_rot = [[] for _ in range(self.L)]  # [layer][token] -> [Hq, d]
        self.cache = [[[] for _ in range(self.hkv)] for _ in range(self.L)]
        self.probs: list[torch.Tensor] = []  # this step's [Hq, T, m] per layer (cache order)
        self.layer_inputs: list[torch.Tensor] = []

    def rope(self, x: torch.Tensor, positions) -> torch.Tensor:
        """HF's rotary embedding: x [T, H, d] at the given positions."""
        pos = torch.tensor([list(positions)], dtype=torch.long)
        cos, sin = self.hf.model.rotary_emb(x[None], pos)
        out, _ = apply_rotary_pos_emb(x[None], x[None], cos, sin, unsqueeze_dim=2)
        return out[0]

    def keys(self, layer: int, head: int) -> torch.Tensor:
        """[m, d] the keys this cache holds, rotated as they should be stored."""
        ids = self.cache[layer][head]
        if not ids:
            return torch.zeros(0, self.d)
        if not self.rerotate:
            return torch.stack([self.k_rot[layer][t][head] for t in ids])
        pre = torch.stack([self.k_pre[layer][t][head] for t in ids])
        return self.rope(pre[:, None], range(len(ids)))[:, 0]

    def values(self, layer: int, head: int) -> torch.Tensor:
        return torch.stack([self.v[layer][t][head] for t in self.cache[layer][head]])

    @torch.no_grad()
    def step(self, token_ids: list[int], select=None) -> torch.Tensor:
        """Feed T tokens (appended to every cache); returns the last row's logits.
        ``select(layer, q_last)`` (decode only) -> per KV head the allowed token ids, or None."""
        T, hq, hkv, d, g = len(token_ids), self.hq, self.hkv, self.d, self.g
        lens = {len(c) for layer in self.cache for c in layer}
        if self.rerotate:
            assert len(lens) == 1, "streamingllm: every cache holds the same count"
            start = lens.pop()
            positions = list(range(start, start + T))  # cache-local positions
        else:
            positions = list(range(self.n, self.n + T))
        new_ids = list(range(self.n, self.n + T))
        x = self.hf.model.embed_tokens(torch.tensor(token_ids))
        self.probs, self.layer_inputs = [], []
        for li, layer in enumerate(self.hf.model.layers):
            self.layer_inputs.append(x)
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(T, hq, d)
            k = a.k_proj(h).view(T, hkv, d)
            v = a.v_proj(h).view(T, hkv, d)
            if getattr(a, "q_norm", None) is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            qr, kr = self.rope(q, positions), self.rope(k, positions)
            for i in range(T):
                self.k_pre[li].append(k[i])
                self.k_rot[li].append(kr[i])
                self.v[li].append(v[i])
                self.q_rot[li].append(qr[i])
            for c in self.cache[li]:
                c.extend(new_ids)
            allowed = select(li, qr[-1]) if (select is not None and T == 1) else None
            out, probs = self._attend(li, qr, allowed)
            self.probs.append(probs)
            x = x + a.o_proj(out.reshape(T, hq * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.n += T
        return self.hf.lm_head(self.hf.model.norm(x))[-1]

    def _attend(self, layer, qr, allowed):
        """Causal attention of the T new rows over each KV head's cache (restricted to
        ``allowed[h]`` token ids when given)."""
        T = qr.shape[0]
        m = len(self.cache[layer][0])
        out = torch.zeros(T, self.hq, self.d)
        probs = torch.zeros(self.hq, T, m, dtype=torch.float64)
        for kvh in range(self.hkv):
            ids = self.cache[layer][kvh]
            K, V = self.keys(layer, kvh).double(), self.values(layer, kvh).double()
            visible = torch.arange(m)[None, :] <= torch.arange(m - T, m)[:, None]  # new row i at m-T+i
            if allowed is not None and allowed[kvh] is not None:
                visible = visible & torch.tensor([t in allowed[kvh] for t in ids])[None, :]
            for qh in range(kvh * self.g, (kvh + 1) * self.g):
                s = qr[:, qh].double() @ K.T / math.sqrt(self.d)
                p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
                out[:, qh] = (p @ V).float()
                probs[qh] = p
        return out, probs


# --------------------------------------------------------- method rules from METHODS.md


class RefMethod:
    """finish(ref, prefill_ended, decoding) -> {(layer, head): Choice} after applying it;
    choose(ref, layer, q_last) -> per-head Choice list, or None for a dense layer."""

    selects = False

    def __init__(self, sink, budget, recent, **knobs):
        self.sink, self.budget, self.recent, self.knobs = sink, budget, recent, knobs

    @property
    def total(self):
        return self.sink + self.budget + self.recent

    def finish(self, ref, prefill_ended, decoding):
        return {}

    def apply(self, ref, plan):
        for (layer, head), choice in plan.items():
            ref.cache[layer][head] = list(choice.kept)
        return plan


class RefStreaming(RefMethod):
    """Keep the first sink and the last recent tokens as soon as a row grows past them."""

    def finish(self, ref, prefill_ended, decoding):
        plan = {}
        for layer in range(ref.L):
            for head in range(ref.hkv):
                ids = ref.cache[layer][head]
                if len(ids) > self.sink + self.recent:
                    plan[layer, head] = Choice(ids[: self.sink] + ids[len(ids) - self.recent:])
        return self.apply(ref, plan)


class RefSnapKV(RefMethod):
    """At the end of prefill: window scores, GQA mean, 1-D pooling, sink + top + tail."""

    def layer_budgets(self, L, n, window):
        return [self.budget] * L

    def pool(self, s):
        kernel, pooling = self.knobs.get("snapkv_kernel", 7), self.knobs.get("snapkv_pooling", "max")
        out = []
        for j in range(len(s)):
            inside = [s[j + o] for o in range(-(kernel // 2), kernel // 2 + 1) if 0 <= j + o < len(s)]
            out.append(max(inside) if pooling == "max" else sum(inside) / kernel)  # padding: 0 / never wins
        return out

    def keep(self, ids, pooled, budget, tail):
        """Cache entries ``ids``: sink + top-``budget`` middle by pooled score + last ``tail``."""
        ranked = {ids[c]: pooled[c] for c in range(self.sink, len(ids) - tail)}
        chosen = set(top(ranked, budget))
        return Choice(ids[: self.sink] + [t for t in ids[self.sink: len(ids) - tail] if t in chosen]
                      + ids[len(ids) - tail:], ranked)

    def finish(self, ref, prefill_ended, decoding):
        window = self.knobs.get("snapkv_window", 32)
        if decoding and self.knobs.get("snapkv_decode_eviction", False):
            return self.decode_finish(ref, window)
        if not prefill_ended:
            return {}
        n = self.prompt = ref.n
        self.steps, self.rows = 0, deque(maxlen=window)
        if n <= self.total:
            return {}
        tail = max(self.recent, window)
        budgets = self.layer_budgets(ref.L, n, window)
        plan = {}
        for layer in range(ref.L):
            assert ref.cache[layer][0] == list(range(n)), "snapkv: the prompt is whole at prefill end"
            if self.sink + tail >= n:  # the window (or recent) covers the prompt
                continue
            prefix = n - window
            for kvh in range(ref.hkv):
                K = torch.stack([ref.k_rot[layer][j][kvh] for j in range(n)]).double()
                s = [0.0] * prefix
                for qh in range(kvh * ref.g, (kvh + 1) * ref.g):
                    for i in range(window):
                        pos = n - window + i
                        logits = K[: pos + 1] @ ref.q_rot[layer][pos][qh].double() / math.sqrt(ref.d)
                        p = torch.softmax(logits, dim=0)
                        for j in range(prefix):
                            s[j] += float(p[j]) / ref.g
                plan[layer, kvh] = self.keep(list(range(n)), self.pool(s), budgets[layer], tail)
        return self.apply(ref, plan)

    def decode_finish(self, ref, window):
        """Every interval decode steps: rescore with the last ``window`` decode queries (the
        attention each received when it ran) and compact back to the total."""
        self.steps += 1
        self.rows.append([[{t: sum(float(ref.probs[layer][qh, 0, c]) for qh in range(kvh * ref.g, (kvh + 1) * ref.g))
                            / ref.g for c, t in enumerate(ref.cache[layer][kvh])}
                           for kvh in range(ref.hkv)] for layer in range(ref.L)])
        if self.steps % self.knobs.get("snapkv_decode_interval", 128):
            return {}
        tail = max(self.recent, window)
        budgets = self.layer_budgets(ref.L, self.prompt, window)
        plan = {}
        for layer in range(ref.L):
            for kvh in range(ref.hkv):
                ids = ref.cache[layer][kvh]
                s = [sum(row[layer][kvh].get(t, 0.0) for row in self.rows) for t in ids[: len(ids) - window]]
                plan[layer, kvh] = self.keep(ids, self.pool(s), budgets[layer], tail)
        return self.apply(ref, plan)


class RefPyramidKV(RefSnapKV):
    """SnapKV with per-layer budgets falling linearly with depth (METHODS.md; rounded to
    the nearest integer, which METHODS.md leaves implicit)."""

    def layer_budgets(self, L, n, window):
        B, beta = self.budget, self.knobs.get("pyramidkv_beta", 20.0)
        if n < 2 * B:
            return [B] * L
        lo = B / beta
        hi = 2 * B - lo
        if hi > n - window:
            hi = n - window
            lo = 2 * B - hi
        return [math.floor(hi - layer * (hi - lo) / (L - 1) + 0.5) for layer in range(L)]


class RefH2O(RefMethod):
    """Accumulated attention received (GQA mean); at prefill end and every interval decode
    steps, a row past the total keeps sink + last recent + top-budget by score."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.h = None
        self.steps = 0

    def finish(self, ref, prefill_ended, decoding):
        if self.h is None:
            self.h = [[{} for _ in range(ref.hkv)] for _ in range(ref.L)]
        for layer in range(ref.L):
            for kvh in range(ref.hkv):
                acc = self.h[layer][kvh]
                for c, t in enumerate(ref.cache[layer][kvh]):
                    got = sum(float(ref.probs[layer][qh, :, c].sum()) for qh in range(kvh * ref.g, (kvh + 1) * ref.g))
                    acc[t] = acc.get(t, 0.0) + got / ref.g
        if decoding:
            self.steps += 1
            if self.steps % self.knobs.get("h2o_decode_interval", 1):
                return {}
        elif not prefill_ended:
            return {}
        else:
            self.steps = 0
        plan = {}
        for layer in range(ref.L):
            for kvh in range(ref.hkv):
                ids = ref.cache[layer][kvh]
                if len(ids) <= self.total:
                    continue
                others = ids[self.sink: len(ids) - self.recent]
                ranked = {t: self.h[layer][kvh][t] for t in others}
                chosen = set(top(ranked, self.budget))
                plan[layer, kvh] = Choice(ids[: self.sink] + [t for t in others if t in chosen]
                                          + ids[len(ids) - self.recent:], ranked)
        return self.apply(ref, plan)


class RefQuest(RefMethod):
    """Per page, KV head and channel key max/min; U = sum_c max(q_c M_c, q_c m_c), max over
    the group; sink pages + recent pages + top max(3, budget // page) others."""

    selects = True

    def choose(self, ref, layer, q):
        P, skip = self.knobs.get("quest_page_size", 16), self.knobs.get("quest_skip_layers", 2)
        if layer < skip:
            return None
        n = len(ref.cache[layer][0])
        if n <= self.total:
            return None
        pages = -(-n // P)
        out = []
        for kvh in range(ref.hkv):
            assert ref.cache[layer][kvh] == list(range(n)), "quest keeps every token"
            K = ref.keys(layer, kvh).double()
            bound = {}
            for p in range(pages):
                M, m = K[p * P:(p + 1) * P].max(0).values, K[p * P:(p + 1) * P].min(0).values
                bound[p] = max(float(torch.maximum(q[qh].double() * M, q[qh].double() * m).sum())
                               for qh in range(kvh * ref.g, (kvh + 1) * ref.g))
            fixed = {p for p in range(pages) if p * P < self.sink}
            if self.recent:
                fixed |= {p for p in range(pages) if (p + 1) * P > n - self.recent}
            ranked = {p: s for p, s in bound.items() if p not in fixed}
            out.append(Choice(sorted(fixed | set(top(ranked, max(3, self.budget // P)))), ranked))
        return out

    def tokens(self, ref, layer, pages):
        P, n = self.knobs.get("quest_page_size", 16), len(ref.cache[layer][0])
        return [t for p in sorted(pages) for t in range(p * P, min((p + 1) * P, n))]


class RefOmniKV(RefMethod):
    """Filter layers attend densely and score each token by the max over all query heads
    of q.k (or of the softmax); sink + top-budget + recent, shared by every head of the
    following layers up to the next filter layer; layers before the first filter are dense."""

    selects = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.filters = sorted(int(x) for x in self.knobs["omnikv_filter_layers"].split(","))
        self.current = None

    def choose(self, ref, layer, q):
        if layer < self.filters[0]:
            return None
        if layer not in self.filters:
            return None if self.current is None else [self.current] * ref.hkv
        self.current = None
        n = len(ref.cache[layer][0])
        if n <= self.total:
            return None
        score = {}
        per_head = []
        for qh in range(ref.hq):
            K = ref.keys(layer, qh // ref.g).double()
            s = K @ q[qh].double() / math.sqrt(ref.d)
            per_head.append(torch.softmax(s, 0) if self.knobs.get("omnikv_score", "logits") == "probs" else s)
        for t in range(n):
            score[t] = max(float(s[t]) for s in per_head)
        ranked = {t: score[t] for t in range(self.sink, n - self.recent)}
        kept = sorted(set(range(self.sink)) | set(top(ranked, self.budget)) | set(range(n - self.recent, n)))
        self.current = Choice(kept, ranked)
        return None  # the filter layer itself attends densely


REF = {"streamingllm": RefStreaming, "snapkv": RefSnapKV, "pyramidkv": RefPyramidKV, "h2o": RefH2O,
       "quest": RefQuest, "omnikv": RefOmniKV}


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


def check_cache(llm, seq, ref: Reference, plan: dict, where: str) -> None:
    """Engine K/V rows of every (layer, KV head) == the reference cache's rows."""
    for layer in range(ref.L):
        K, V = llm.cache.gather(seq, layer)
        for head in range(ref.hkv):
            want = ref.keys(layer, head)
            if K.shape[0] == want.shape[0] and torch.allclose(K[:, head], want, atol=ATOL, rtol=1e-4):
                got = None
            else:
                got = identify(ref, layer, head, K[:, head])
                choice = plan.get((layer, head))
                assert choice is not None and tie_ok(got, choice), (
                    f"{where}: layer {layer} KV head {head}: engine keeps {got}, reference keeps "
                    f"{ref.cache[layer][head]}")
                assert got == sorted(got), f"{where}: layer {layer} head {head}: cache not in token order"
                ref.cache[layer][head] = got  # ties aside: continue from the engine's choice
                want = ref.keys(layer, head)
                assert torch.allclose(K[:, head], want, atol=ATOL, rtol=1e-4), where
            assert torch.allclose(V[:, head], ref.values(layer, head), atol=ATOL, rtol=1e-4), (
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
                            chunk=2048, **knobs):
    folder, hf = model(name)
    rerotate = bool(knobs.get("streamingllm_rerotate", False))
    ref = Reference(hf, rerotate=rerotate)
    rule = REF[method](sink, budget, recent, **knobs)
    llm = LLM(str(folder), dtype="float32", device="cpu", sparse_method=method, sink_tokens=sink,
              budget=budget, recent_tokens=recent, kv_cache_memory=0.01,
              page_size=knobs.get("quest_page_size", 16) if method == "quest" else 8,  # quest pages = cache pages
              prefill_chunk_size=chunk, **knobs)
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
            check_cache(llm, seq, ref, plan, where)
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
]


@pytest.mark.parametrize("name,n,sink,recent,rerotate,chunk,steps", STREAMING)
def test_streamingllm_keeps_sink_and_recent(model, name, n, sink, recent, rerotate, chunk, steps):
    seq, ref = run_engine_vs_reference(model, name, "streamingllm", prompt(n, seed=n), sink=sink,
                                       budget=0, recent=recent, decode_steps=steps, chunk=chunk,
                                       streamingllm_rerotate=rerotate)
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
]


@pytest.mark.parametrize("name,n,sink,budget,recent,chunk,steps,knobs", H2O)
def test_h2o_keeps_heavy_hitters(model, name, n, sink, budget, recent, chunk, steps, knobs):
    seq, ref = run_engine_vs_reference(model, name, "h2o", prompt(n, seed=n + 3), sink=sink,
                                       budget=budget, recent=recent, decode_steps=steps, chunk=chunk,
                                       **knobs)
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
]


@pytest.mark.parametrize("name,n,sink,budget,recent,knobs", QUEST)
def test_quest_selects_reference_pages(model, name, n, sink, budget, recent, knobs):
    run_engine_vs_reference(model, name, "quest", prompt(n, seed=n + 4), sink=sink, budget=budget,
                            recent=recent, decode_steps=3, **knobs)


def test_quest_without_recent_tokens_selects_whole_valid_pages(model):
    run_engine_vs_reference(model, "g4", "quest", prompt(61, seed=1), sink=4, budget=8, recent=0,
                            decode_steps=3, quest_page_size=8, quest_skip_layers=0)


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


# ------------------------------------------------------- covering budget == vanilla

NEW = 10
PROMPT_LENS = (37, 52)
COVER = max(PROMPT_LENS) + NEW - 1  # the most tokens a cache ever holds


def covering(method: str) -> dict:
    """Knobs whose total is exactly COVER: nothing may be evicted or skipped."""
    base = dict(sink_tokens=4, recent_tokens=8, budget=COVER - 12)
    return {
        "vanilla": {},
        "streamingllm": dict(sparse_method="streamingllm", sink_tokens=4, recent_tokens=COVER - 4, budget=0),
        "streamingllm_rerotate": dict(sparse_method="streamingllm", sink_tokens=4, recent_tokens=COVER - 4,
                                      budget=0, streamingllm_rerotate=True),
        "snapkv": dict(base, sparse_method="snapkv", snapkv_window=8),
        "pyramidkv": dict(base, sparse_method="pyramidkv", snapkv_window=8),
        "h2o": dict(base, sparse_method="h2o"),
        "omnikv": dict(base, sparse_method="omnikv", omnikv_filter_layers="1"),
        "quest": dict(base, sparse_method="quest", quest_page_size=8, quest_skip_layers=0),
    }[method]


@pytest.mark.parametrize("name", ["g2", "g3", "g4"])
def test_covering_budget_generates_vanilla_tokens(model, name):
    folder, hf = model(name)
    ids = [prompt(n, seed=7 * n) for n in PROMPT_LENS]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outputs = {}
    for method in ("vanilla", "streamingllm", "streamingllm_rerotate", "snapkv", "pyramidkv", "h2o",
                   "omnikv", "quest"):
        with LLM(str(folder), dtype="float32", device="cpu", page_size=8, kv_cache_memory=0.01,
                 **covering(method)) as llm:
            outputs[method] = [o.token_ids for o in llm.generate(ids, params)]
    for method, tokens in outputs.items():
        assert tokens == outputs["vanilla"], f"{method} differs from vanilla with a covering budget"
