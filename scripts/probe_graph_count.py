"""Does a CUDA graph replay slower once more graphs were captured in the process? (GPU.)

A graph of `--kernels` small kernels (launch-bound: its time is mostly the gaps between
kernels) and one of `--kernels` 1 MiB copies are timed (device events, median of
`--replays` replays); then `--extra` more graphs of the same kind are captured one at a
time, and both are timed again after each (also replayed on a side stream and on a
high-priority one), then once more after the extra graphs are dropped. Prints one JSON line
per state. `--mode` says what an extra step does (a capture, one never instantiated, a bare
`capture_begin`/`capture_end`, or only the synchronize, gc and empty_cache that
`torch.cuda.graph` does around a capture); `--capture-mode`, torch's `capture_error_mode`.
On the H200 the fourth capture in the process slows every later replay (results/README.md,
session 23; `graph_capture_state_h200.jsonl`).

    python scripts/probe_graph_count.py --extra 6
"""
from __future__ import annotations

import argparse
import gc
import json
import os

import torch


def capture(fn, keep_graph: bool = False, capture_mode: str = "global") -> torch.cuda.CUDAGraph:
    """keep_graph: captured, not instantiated (torch instantiates at the first replay)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    with torch.cuda.graph(g, capture_error_mode=capture_mode):
        fn()
    return g


def replay_ms(g: torch.cuda.CUDAGraph, replays: int, stream=None) -> float:
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        return _replay_ms(g, replays)


def _replay_ms(g: torch.cuda.CUDAGraph, replays: int) -> float:
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in times)
    return ms[len(ms) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=700)
    ap.add_argument("--extra", type=int, default=6)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--mode", choices=("capture", "uninstantiated", "raw", "empty_cache"), default="capture",
                    help="each extra step: a torch.cuda.graph capture; one never instantiated; capture_begin/end "
                         "on a side stream without torch.cuda.graph's synchronize, gc and empty_cache; or only those")
    ap.add_argument("--capture-mode", choices=("global", "thread_local", "relaxed"), default="global")
    args = ap.parse_args()
    small = torch.zeros(256, device="cuda")
    src, dst = torch.zeros(1 << 18, device="cuda"), torch.zeros(1 << 18, device="cuda")

    def tiny():
        for _ in range(args.kernels):
            small.add_(1)

    def copies():
        for _ in range(args.kernels):
            dst.copy_(src)

    keep = {"tiny": capture(tiny, capture_mode=args.capture_mode),
            "copies": capture(copies, capture_mode=args.capture_mode)}
    extra: list = []
    report = _report(keep, args.replays)
    for n in range(args.extra + 1):
        if n:
            extra.append(_extra(args.mode, tiny if n % 2 else copies, args.capture_mode))
        report(2 + len(extra))
    extra.clear()
    gc.collect()
    torch.cuda.synchronize()
    report(2, "after dropping the extra graphs")


def _extra(mode: str, fn, capture_mode: str):
    if mode == "empty_cache":
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        return None
    if mode != "raw":
        return capture(fn, mode == "uninstantiated", capture_mode)
    fn()
    g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g.capture_begin()
        fn()
        g.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return g


def _report(keep, replays):
    side = torch.cuda.Stream()
    hi = torch.cuda.Stream(priority=-1)

    def report(graphs: int, note: str = "") -> None:
        print(json.dumps({"kind": "graph_count", "extra_steps": graphs - 2, "note": note,
                          **{k: round(replay_ms(g, replays), 4) for k, g in keep.items()},
                          **{f"{k}_side_stream": round(replay_ms(g, replays, side), 4) for k, g in keep.items()},
                          **{f"{k}_high_priority": round(replay_ms(g, replays, hi), 4) for k, g in keep.items()},
                          "env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_")},
                          "device": torch.cuda.get_device_name()}), flush=True)
    return report


if __name__ == "__main__":
    main()
