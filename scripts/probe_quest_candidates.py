"""How many shortlist candidates does Quest's page selection see in the engine? (GPU, eager.)

The selection kernel (`kernels/quest_select.py`) takes its choice from the middle keys >=
L, a lower bound of the m-th largest group maximum settled to its top `L_BITS` bits; a row
with more than `cap` candidates runs the full search (~3x the time of a launch). This
probe runs the benchmark's engine eagerly, after `--before-batches` as the lane runs them
(the synthesised KV is seeded by request id, so earlier requests change the batch's data),
and for every selection launch recomputes in torch, from the scores the kernel gets, each
row's candidate count at several `L_BITS`. Prints one JSON line per (before, bits).

`--hints`: instead, how well would the previous decode step's threshold bound this step's?
For every (layer, request, KV head) the exact m-th largest middle bound t of each step is
kept; the next step's middle bounds are counted against hints taken from it (t itself, t
lowered by a fraction `delta` of |t|, and last step's L). A hint is exact to use when at
least m middle bounds reach it (then every page the choice takes is >= it) and useful when
at most `cap` do. Prints one JSON line per hint.

    python scripts/probe_quest_candidates.py --batch 6 --before 'none' --before 1,2,4
    python scripts/probe_quest_candidates.py --batch 6 --hints --steps 24
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode_step import engine_kwargs, prompts_of  # noqa: E402

from sparseengine import LLM, SamplingParams, kernels  # noqa: E402
from sparseengine.kernels._common import cdiv  # noqa: E402
from sparseengine.kernels.quest_select import shortlist_groups, shortlist_room  # noqa: E402


def keys_of(scores: torch.Tensor) -> torch.Tensor:
    """The kernel's int32 keys as int64 in [0, 2^32), ordered as the floats."""
    bits = torch.where(scores == 0, torch.zeros_like(scores), scores).float().view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return keys.to(torch.int64) + 2 ** 31


def candidate_counts(scores, kv_lens, page_size, sink, recent, budget, bits_list) -> dict[int, list[int]]:
    """Per L_BITS, every searched row's candidate count (the kernel's shortlist rule)."""
    B, H, P = scores.shape
    top, sink_pages = max(3, budget // page_size), cdiv(sink, page_size)
    group = shortlist_groups(P, top)
    if group is None:  # no shortlist: the full search alone
        return {b: [] for b in bits_list}
    keys = keys_of(scores)
    out: dict[int, list[int]] = {b: [] for b in bits_list}
    for b, n in enumerate(kv_lens.tolist()):
        recent_first = max(n - recent, 0) // page_size if recent else cdiv(n, page_size)
        if n <= sink + budget + recent or recent_first - sink_pages <= top:
            continue
        m = top
        mid = keys[b, :, sink_pages:recent_first]  # [H, M]
        pad = (-(sink_pages + mid.shape[1])) % group
        full = torch.full((H, sink_pages + mid.shape[1] + pad), -1, dtype=torch.int64, device=keys.device)
        full[:, sink_pages:sink_pages + mid.shape[1]] = mid
        gmax = full.view(H, -1, group).amax(-1)
        kth = gmax.topk(m, -1).values[:, -1]  # [H]
        for lb in bits_list:
            low = kth & ~((1 << (32 - lb)) - 1) if lb < 32 else kth
            out[lb].extend((mid >= low[:, None]).sum(-1).tolist())
    return out


def middle_keys(scores, kv_lens, page_size, sink, recent, budget):
    """Per request b: (keys of its middle pages [H, M] as keys_of, m), or None where the choice takes them all."""
    top, sink_pages = max(3, budget // page_size), cdiv(sink, page_size)
    keys = keys_of(scores)
    rows = []
    for b, n in enumerate(kv_lens.tolist()):
        recent_first = max(n - recent, 0) // page_size if recent else cdiv(n, page_size)
        if n <= sink + budget + recent or recent_first - sink_pages <= top:
            rows.append(None)
            continue
        rows.append((keys[b, :, sink_pages:recent_first], top))
    return rows


class HintStats:
    """Counts, for each hint rule, the middle bounds of each row that reach the hint built from the
    same (layer, request, KV head)'s previous step."""

    DELTAS = (0.0, 1 / 256, 1 / 64, 1 / 32, 1 / 16, 1 / 8)

    def __init__(self, layers: int, cap: int) -> None:
        self.layers, self.cap, self.calls = layers, cap, 0
        self.prev: dict[int, list] = {}  # layer -> per request: (t float [H], L key [H]) or None
        self.counts: dict[str, list[tuple[int, int]]] = {}  # hint -> (count, m) per row

    def __call__(self, scores, kv_lens, page_size, sink, recent, budget) -> None:
        layer = self.calls % self.layers
        self.calls += 1
        rows = middle_keys(scores, kv_lens, page_size, sink, recent, budget)
        group = shortlist_groups(scores.shape[-1], max(3, budget // page_size))
        now = []
        for b, row in enumerate(rows):
            if row is None:
                now.append(None)
                continue
            mid, m = row
            t_key = mid.topk(m, -1).values[:, -1]  # [H]
            k32 = (t_key - 2 ** 31).to(torch.int32)
            t = (k32 ^ ((k32 >> 31) & 0x7FFFFFFF)).view(torch.float32)  # keys_of inverted
            H, M = mid.shape
            pad = (-M) % group
            gmax = torch.cat([mid, mid.new_full((H, pad), -1)], 1).view(H, -1, group).amax(-1)
            low = gmax.topk(m, -1).values[:, -1] & ~((1 << 16) - 1)
            now.append((t, low))
            before = self.prev.get(layer)
            if before is None or before[b] is None:
                continue
            t_prev, low_prev = before[b]
            hints = {f"t_minus_{d:g}": keys_of(t_prev - d * t_prev.abs()) for d in self.DELTAS}
            hints["L16_prev"] = low_prev
            for name, hint in hints.items():
                c = (mid >= hint[:, None]).sum(-1).tolist()
                self.counts.setdefault(name, []).extend((x, m) for x in c)
        self.prev[layer] = now

    def rows(self) -> list[dict]:
        out = []
        for name, cm in self.counts.items():
            c = sorted(x for x, _ in cm)
            exact = sum(x >= m for x, m in cm)
            useful = sum(m <= x <= self.cap for x, m in cm)
            out.append({"kind": "quest_hint", "hint": name, "rows": len(cm), "exact": exact / len(cm),
                        "exact_within_cap": useful / len(cm), "cap": self.cap, "median": c[len(c) // 2],
                        "p99": c[int(0.99 * (len(c) - 1))], "max": c[-1]})
        return out


def generate_hooked(llm, hook, args) -> None:
    """The probe's batch (``args.batch`` prompts of ``args.prompt_len``) for ``args.steps``
    decode steps, with ``hook`` called in place of the Triton page choice (restored after)."""
    orig = kernels.quest_select_pages_triton
    kernels.quest_select_pages_triton = hook
    try:
        llm.generate(prompts_of([args.prompt_len] * args.batch),
                     SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True), prefill="synthesized")
    finally:
        kernels.quest_select_pages_triton = orig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--before", action="append", default=[], metavar="B1,B2|none",
                    help="batches run first in the same engine (repeatable: one engine per value)")
    ap.add_argument("--bits", default="12,16,20,24,32")
    ap.add_argument("--hints", action="store_true", help="the previous step's threshold as this step's (above)")
    args = ap.parse_args()
    bits_list = [int(b) for b in args.bits.split(",")]
    orig = kernels.quest_select_pages_triton
    if args.hints:
        kw = engine_kwargs("quest", args.batch, args.prompt_len + 2048, enforce_eager=True)
        with LLM(**kw) as llm:
            stats = HintStats(llm.model_config.num_layers - int(llm.config.knob("quest_skip_layers")),
                              shortlist_room(max(3, llm.config.budget // llm.config.page_size)))

            def hint_hook(scores, kv_lens, page_size, sink, recent, budget, **kw):
                stats(scores, kv_lens, page_size, sink, recent, budget)
                return orig(scores, kv_lens, page_size, sink, recent, budget, **kw)

            generate_hooked(llm, hint_hook, args)
        for row in stats.rows():
            row.update(device=torch.cuda.get_device_name(), commit=os.environ.get("SPARSEENGINE_GIT_COMMIT", "unknown"),
                       batch=args.batch, steps=args.steps)
            print(json.dumps(row), flush=True)
        return
    for before in args.before or ["none"]:
        counts: dict[int, list[int]] = {b: [] for b in bits_list}
        cap = [0]

        def hook(scores, kv_lens, page_size, sink, recent, budget, **kw):
            cap[0] = shortlist_room(max(3, budget // page_size))
            for lb, c in candidate_counts(scores, kv_lens, page_size, sink, recent, budget, bits_list).items():
                counts[lb].extend(c)
            return orig(scores, kv_lens, page_size, sink, recent, budget, **kw)

        kw = engine_kwargs("quest", args.batch, args.prompt_len + 2048, enforce_eager=True)
        with LLM(**kw) as llm:
            for b in [int(x) for x in before.split(",") if x and before != "none"]:
                llm.generate(prompts_of([args.prompt_len] * b, salt=11),
                             SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), prefill="synthesized")
            generate_hooked(llm, hook, args)
        for lb, c in counts.items():
            c = sorted(c)
            print(json.dumps({"kind": "quest_candidates", "before": before, "l_bits": lb, "cap": cap[0],
                              "rows": len(c), "over_cap": sum(x > cap[0] for x in c), "median": c[len(c) // 2],
                              "p99": c[int(0.99 * (len(c) - 1))], "max": c[-1],
                              "device": torch.cuda.get_device_name(),
                              "commit": os.environ.get("SPARSEENGINE_GIT_COMMIT", "unknown")}), flush=True)


if __name__ == "__main__":
    main()
