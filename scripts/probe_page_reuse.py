"""Does a batch decode slower on pages that earlier requests used? (H200, Quest b=6, 128K.)

One engine, as the benchmark's lane keeps one for all its batch sizes: the graph step of a
batch on a fresh pool, then of the same batch again (its pages now from the free queue in
the order the first batch freed them), then again with the free queue first sorted
ascending. Prints one JSON line per run.

    python scripts/probe_page_reuse.py --method quest --batch 6
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode_step import engine_kwargs, prompts_of, step_time  # noqa: E402

from sparseengine import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="quest")
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=131072)
    ap.add_argument("--window-steps", type=int, default=128)
    args = ap.parse_args()
    prompts = prompts_of([args.prompt_len] * args.batch)
    with LLM(**engine_kwargs(args.method, args.batch, args.prompt_len + 2048)) as llm:
        for run in ("fresh", "reused", "reused_sorted", "reused_again"):
            if run == "reused_sorted":
                llm.allocator._free = collections.deque(sorted(llm.allocator._free))
            first = list(llm.allocator._free)[:3]
            ms = 1e3 * step_time(llm, prompts, args.window_steps)
            print(json.dumps({"kind": "page_reuse", "run": run, "method": args.method, "batch": args.batch,
                              "graph_step_ms": ms, "free_queue_head": first,
                              "device": torch.cuda.get_device_name(),
                              "commit": os.environ.get("SPARSEENGINE_GIT_COMMIT", "unknown")}), flush=True)


if __name__ == "__main__":
    main()
