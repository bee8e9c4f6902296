"""A decode step's timeline by layer, from the launch sequence a profile records
(`profile_decode_step.py --launch-sequence .`, or `LAUNCH_SEQ=. bash scripts/gpu_session.sh variants`):
the launches cut into cycles, each starting at a launch of the anchor kernel (one a layer:
Quest's page scores by default), and for each position of a cycle its kernel, its median
time from its start to the next launch's start, and its median duration (with PDL a kernel
starts before the one before it ends, so durations overlap; start to next start does not).

    python scripts/show_timeline.py PROFILE.json [--anchor REGEX] [--bytes NAME=MB ...] [--gbps G]

`--bytes` gives a position's bytes (MB), its kernel's name shortened as printed (a name's
second launch in a cycle as NAME#2): the
time they take at `--gbps` (default: the profile's `bandwidth_gbps`) is printed beside it.
A results `.jsonl` of profile rows takes `--row N` (the N-th row with a launch sequence).
Session 55 read Quest's b=3 step on an H100 with it (results/README.md)."""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

SHORT = ((r"linear_kernel<false, true>", "qkv"), (r"linear_kernel<true, false>", "gate_up"),
         (r"linear_kernel<false, false>", "linear"), (r"scores_kernel", "scores"), (r"select_kernel", "choice"),
         (r"_decode_split_kernel", "split"), (r"_combine_splits_kernel", "merge"))


def short(name: str) -> str:
    for pattern, label in SHORT:
        if re.search(pattern, name):
            return label
    return name[:24]


def layer_cycles(launches: list[dict], anchor: str) -> list[dict]:
    """Per position of the cycles that start at each launch matching `anchor` and run to the
    next one: {"kernel", "to_next_us", "us", "cycles"} (medians over the cycles whose
    kernels match the first full cycle's, position by position). [] with fewer than two
    anchor launches."""
    rx = re.compile(anchor)
    starts = [i for i, r in enumerate(launches) if rx.search(r["name"])]
    if len(starts) < 2:
        return []
    cycles = [launches[a:b + 1] for a, b in zip(starts, starts[1:])]  # each with the next cycle's first launch
    shape = [short(r["name"]) for r in cycles[0]]
    same = [c for c in cycles if [short(r["name"]) for r in c] == shape]
    labels = [k if shape[:j].count(k) == 0 else f"{k}#{shape[:j].count(k) + 1}" for j, k in enumerate(shape)]
    return [{"kernel": labels[j], "to_next_us": statistics.median(c[j + 1]["at_us"] - c[j]["at_us"] for c in same),
             "us": statistics.median(c[j]["us"] for c in same), "cycles": len(same)} for j in range(len(shape) - 1)]


def _profile(path: str, row: int) -> dict:
    if not path.endswith(".jsonl"):
        return json.load(open(path))
    rows = [r for r in map(json.loads, open(path)) if isinstance(r.get("graph_launch_sequence"), dict)]
    if not rows:
        raise SystemExit(f"{path}: no row with a launch sequence")
    return rows[row]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile")
    ap.add_argument("--anchor", default="scores_kernel")
    ap.add_argument("--row", type=int, default=0)
    ap.add_argument("--bytes", nargs="*", default=[], help="NAME=MB, a position's bytes")
    ap.add_argument("--gbps", type=float)
    args = ap.parse_args(argv)
    prof = _profile(args.profile, args.row)
    launches = (prof.get("graph_launch_sequence") or {}).get("launches")
    if not isinstance(launches, list):
        raise SystemExit(f"{args.profile}: no launch sequence ({launches!r})")
    gbps = args.gbps or prof.get("bandwidth_gbps")
    mb = {k: float(v) for k, v in (b.split("=", 1) for b in args.bytes)}
    rows = layer_cycles(launches, args.anchor)
    if not rows:
        raise SystemExit(f"fewer than two launches match {args.anchor!r}")
    print(f"{rows[0]['cycles']} cycles; graph step {prof.get('graph_step_ms', float('nan')):.3f} ms")
    for r in rows:
        at = f"  {mb[r['kernel']] / gbps * 1e3:7.2f} us at {gbps:.0f} GB/s" if r["kernel"] in mb and gbps else ""
        print(f"{r['kernel']:10s} start to next {r['to_next_us']:7.2f} us  duration {r['us']:7.2f} us{at}")
    print(f"cycle {sum(r['to_next_us'] for r in rows):.1f} us")


if __name__ == "__main__":
    main(sys.argv[1:])
