"""How many shortlist candidates does Quest's page selection see in the engine? (GPU, eager.)

The selection kernel (`kernels/quest_select.py`) takes its choice from the middle keys >=
L, a lower bound of the m-th largest group maximum settled to its top `L_BITS` bits; a row
with more than `cap` candidates runs the full search (~3x the time of a launch). This
probe runs the benchmark's engine eagerly, after `--before-batches` as the lane runs them
(the synthesised KV is seeded by request id, so earlier requests change the batch's data),
and for every selection launch recomputes in torch, from the scores the kernel gets, each
row's candidate count at several `L_BITS`. Prints one JSON line per (before, bits).

    python scripts/probe_quest_candidates.py --batch 6 --before 'none' --before 1,2,4
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--before", action="append", default=[], metavar="B1,B2|none",
                    help="batches run first in the same engine (repeatable: one engine per value)")
    ap.add_argument("--bits", default="12,16,20,24,32")
    args = ap.parse_args()
    bits_list = [int(b) for b in args.bits.split(",")]
    orig = kernels.quest_select_pages_triton
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
            kernels.quest_select_pages_triton = hook
            try:
                llm.generate(prompts_of([args.prompt_len] * args.batch),
                             SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True),
                             prefill="synthesized")
            finally:
                kernels.quest_select_pages_triton = orig
        for lb, c in counts.items():
            c = sorted(c)
            print(json.dumps({"kind": "quest_candidates", "before": before, "l_bits": lb, "cap": cap[0],
                              "rows": len(c), "over_cap": sum(x > cap[0] for x in c), "median": c[len(c) // 2],
                              "p99": c[int(0.99 * (len(c) - 1))], "max": c[-1],
                              "device": torch.cuda.get_device_name(),
                              "commit": os.environ.get("SPARSEENGINE_GIT_COMMIT", "unknown")}), flush=True)


if __name__ == "__main__":
    main()
