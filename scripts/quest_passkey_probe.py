"""Why does Quest miss a passkey? Probe the 2K passkey prompts of
tests/test_method_behaviour.py on SmolLM2 (sink 16, recent 64, budget 432).

For each key and variant it records the generated text and, per decode step, layer and KV
head, whether the selection covered every token of the needle's digits. Variants:
- ``quest``: the method as defined (page upper bound U, METHODS.md "quest").
- ``oracle``: the same page count, pages ranked by the exact ``max_k q.k`` over the page
  (what U bounds from above): is the bound's ranking the cause? (CPU, torch provider: the
  runtime scores pages with ``quest_page_scores_torch``, which this variant replaces.)
- ``quest_2x``: Quest at twice the budget.

    python scripts/quest_passkey_probe.py --out results/quest_passkey_probe.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparseengine import LLM, SamplingParams  # noqa: E402
from sparseengine.methods import quest as quest_mod  # noqa: E402
from tests.test_method_behaviour import KEYS, passkey_prompt  # noqa: E402


def needle_digit_positions(tok, prompt: list[int], key: int) -> list[int]:
    """Prompt positions of the first occurrence of the key's digit tokens."""
    digits = tok.encode(f" The pass key is {key}.", add_special_tokens=False)
    for i in range(len(prompt) - len(digits)):
        if prompt[i:i + len(digits)] == digits:
            text = [tok.decode([t]) for t in digits]
            return [i + j for j, t in enumerate(text) if t.strip().isdigit()]
    raise ValueError("needle not found in prompt")


class Recorder:
    """Wraps the runtime's select to log needle coverage per (step, layer, KV head)."""

    def __init__(self, rt, needle: list[int]) -> None:
        self.rt, self.needle, self.rows, self.step = rt, torch.tensor(needle), [], -1
        self.inner = rt.select
        rt.select = self.select

    def select(self, layer, q, ctx):
        sel = self.inner(layer, q, ctx)
        if layer == 0 and ctx.is_decode:
            self.step += 1
        if sel is None or not ctx.is_decode:
            return sel
        idx, count = sel.token_indices[0], sel.num_selected[0]
        page = getattr(sel, "page_size", 0)
        for h in range(idx.shape[0]):
            chosen = idx[h, : int(count[h])]
            if page:
                chosen = (chosen[:, None] * page + torch.arange(page)).flatten()
            covered = torch.isin(self.needle, chosen)
            self.rows.append((self.step, layer, h, int(covered.sum()), len(self.needle)))
        return sel


def exact_page_scores(stash):
    """Replacement for Quest's page scores (same signature as ``quest_page_scores_torch``):
    the exact ``max_k q.k`` over each page's cached tokens, max over the group's heads."""

    def scores(q, kmax, kmin, page_table, kv_lens, page_size):
        k_cache = stash["k_cache"]  # [pages, page_size, Hkv, d] of the layer being scored
        B, hq, d = q.shape
        P, hkv = page_table.shape[1], k_cache.shape[2]
        k = k_cache[page_table.long()].flatten(1, 2).float()  # [B, P * page_size, Hkv, d]
        s = torch.einsum("bhgd,bnhd->bhgn", q.float().reshape(B, hkv, hq // hkv, d), k).amax(2)
        valid = torch.arange(P * page_size)[None, :] < kv_lens.long()[:, None]
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        return s.reshape(B, hkv, P, page_size).amax(-1)

    return scores


def run(folder, prompts, needles, variant: str, tok) -> list[dict]:
    budget = 864 if variant == "quest_2x" else 432
    out = []
    with LLM(folder, dtype="float32", sparse_method="quest", sink_tokens=16, recent_tokens=64,
             budget=budget) as llm:
        rt = llm.method
        saved = (quest_mod.quest_page_scores_torch, quest_mod.Quest.select)
        if variant == "oracle":
            stash: dict = {}

            def select(self, layer, q, ctx):
                stash["k_cache"] = ctx.kv_cache.layer(layer)[0]
                return saved[1](self, layer, q, ctx)

            quest_mod.Quest.select = select
            quest_mod.quest_page_scores_torch = exact_page_scores(stash)
        try:
            for key, prompt, needle in zip(KEYS, prompts, needles):
                rec = Recorder(rt, needle)
                text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=7))[0].text
                rt.select = rec.inner
                layers = sorted({r[1] for r in rec.rows})
                for layer in layers:
                    rows = [r for r in rec.rows if r[1] == layer]
                    full = sum(r[3] == r[4] for r in rows)
                    out.append(dict(variant=variant, key=key, found=str(key) in text, text=text.strip(),
                                    layer=layer, head_steps=len(rows), needle_fully_covered=full,
                                    needle_tokens_covered_frac=round(sum(r[3] for r in rows)
                                                                    / max(1, sum(r[4] for r in rows)), 3)))
        finally:
            quest_mod.quest_page_scores_torch, quest_mod.Quest.select = saved
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/quest_passkey_probe.csv")
    ap.add_argument("--variants", default="quest,oracle,quest_2x")
    args = ap.parse_args()
    from sparseengine.models import loader

    folder = str(loader.resolve(loader.EMBEDDED_MODEL, "auto").folder)
    with LLM(folder, dtype="float32") as llm:
        tok = llm.tokenizer
    prompts = [passkey_prompt(tok, 2048, 0.5, k) for k in KEYS]
    needles = [needle_digit_positions(tok, p, k) for p, k in zip(prompts, KEYS)]
    rows = []
    for variant in args.variants.split(","):
        rows += run(folder, prompts, needles, variant, tok)
        for key in KEYS:
            r = [x for x in rows if x["variant"] == variant and x["key"] == key]
            print(f"{variant:9s} key={key} found={r[0]['found']} text={r[0]['text']!r} "
                  f"needle covered (mean over layers) {sum(x['needle_tokens_covered_frac'] for x in r) / len(r):.3f}",
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
