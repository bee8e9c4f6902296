"""The independent reference of tests/methods/test_engine_selection.py: the model forward
rebuilt from the Hugging Face twin's own modules over per-(layer, KV head) caches of
logical token ids, and each method's rule written straight from METHODS.md with plain
loops. Nothing here imports ``sparseengine.methods``."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

SCORE_RTOL = 1e-4  # "ties aside": scores this close (relative to the largest) may swap

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
        T, hq, hkv, d = len(token_ids), self.hq, self.hkv, self.d
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
