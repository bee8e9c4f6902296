"""Host time of FlashInfer's graph plans a decode step (GPU, flashinfer installed).

`FlashInferAttentionProvider.plan_graph_step` over `--layers` layers of distinct lengths
(PyramidKV's case: one plan a layer) for `--batch` rows growing a token a step, timed on
the host per call (no profiler on), with the number of FlashInfer `plan` calls it made;
then the same steps again under cProfile (its top is printed). Two modes in one
process: `refresh` (the provider as it is: a plan whose page counts did not change is
refreshed) and `replan` (every plan forgotten before each call: FlashInfer's plan every
step, as before the refresh). Writes one JSON line a (batch, mode) to `--out`, and prints the
cProfile top of each.

    python scripts/probe_flashinfer_graph_plans.py --batch 8 64 --out plans.jsonl
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import numpy as np
import torch


def run(batch: int, layers: int, steps: int, replan: bool, prompt: int, page_size: int = 16):
    import flashinfer

    from sparseengine.attention.flashinfer_provider import FlashInferAttentionProvider

    dev = torch.device("cuda")
    fi = FlashInferAttentionProvider(dev)
    width = -(-(prompt + 2 * steps) // page_size)
    k_cache = torch.empty(1, page_size, 8, 128, dtype=torch.bfloat16, device=dev)  # plans read its shape only
    table = torch.randint(0, 1 << 20, (batch, width), dtype=torch.int32, device=dev)
    rng = np.random.default_rng(0)
    base = (prompt - rng.integers(0, page_size * 8, size=batch))[None] - 37 * np.arange(layers)[:, None]
    calls = []
    real = flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan

    def counted(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan = counted
    graph = ("probe", batch)
    try:
        fi.plan_graph_step(graph, base, table, k_cache, 32)  # first plans (allocations)
        torch.cuda.synchronize()
        calls.clear()
        times = []
        prof = cProfile.Profile()
        for s in range(1, 2 * steps + 1):  # timed, then profiled
            if replan:
                for p in fi._graph_plans._plans[graph]:
                    p.planned = None
            t0 = time.perf_counter()
            if s > steps:
                prof.enable()
            fi.plan_graph_step(graph, base + s, table, k_cache, 32)
            prof.disable()
            if s <= steps:
                times.append(time.perf_counter() - t0)
                timed_calls = len(calls)
            torch.cuda.synchronize()  # as DecodeGraphs' staging event lets the next step write
    finally:
        flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan = real
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(18)
    t = np.array(times) * 1e6
    return {"batch": batch, "layers": layers, "steps": steps, "mode": "replan" if replan else "refresh",
            "host_us_per_step_mean": float(t.mean()), "host_us_per_step_median": float(np.median(t)),
            "host_us_per_step_max": float(t.max()), "flashinfer_plans_per_step": timed_calls / steps}, text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=2048, help="rows' length at the first step (tokens)")
    ap.add_argument("--commit", default=os.environ.get("SPARSEENGINE_GIT_COMMIT", ""))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.out, "a") as f:
        for batch in args.batch:
            for replan in (False, True):
                row, prof = run(batch, args.layers, args.steps, replan, args.prompt)
                row.update(commit=args.commit, device=torch.cuda.get_device_name())
                f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
                print(prof, flush=True)


if __name__ == "__main__":
    main()
