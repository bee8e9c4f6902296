"""A decode step's timeline by layer, from the launch sequence a profile records
(`profile_decode_step.py --launch-sequence .`, or `LAUNCH_SEQ=. bash scripts/gpu_session.sh variants`):
the launches cut into cycles, each starting at a launch of the anchor kernel (one a layer:
Quest's page scores by default), and for each position of a cycle its kernel, its median
time from its start to the next launch's start, its median duration (with PDL a kernel
starts before the one before it ends, so durations overlap; start to next start does not),
and how far its end lies past the ends of the launches before it (the critical path a launch
at a time: where a kernel starts early on a PDL signal, the time it adds after the one
before has ended; compare it with the time its bytes take).

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
         (r"_decode_split_kernel", "split"), (r"_combine_splits_kernel", "merge"), (r"attend_kernel", "attention"))


def short(name: str) -> str:
    for pattern, label in SHORT:
        if re.search(pattern, name):
            return label
    return name[:24]


def layer_cycles(launches: list[dict], anchor: str) -> list[dict]:
    """Per position of the cycles that start at each launch matching `anchor` and run to the
    next one: {"kernel", "to_next_us", "us", "past_end_us", "cycles"} (medians over the
    cycles whose kernels match the first full cycle's, position by position). `past_end_us`:
    how far the launch's end lies past the latest end of the launches before it (0 for one
    that ends inside another): the step's critical path, one launch at a time, whose sum
    over a cycle is its end-to-end time even where PDL overlaps neighbours. [] with fewer
    than two anchor launches."""
    rx = re.compile(anchor)
    starts = [i for i, r in enumerate(launches) if rx.search(r["name"])]
    if len(starts) < 2:
        return []
    past, latest = [], float("-inf")
    for r in launches:
        end = r["at_us"] + r["us"]
        past.append(max(0.0, end - latest) if latest > float("-inf") else None)
        latest = max(latest, end)
    cycles = [range(a, b + 1) for a, b in zip(starts, starts[1:])]  # each with the next cycle's first launch
    shape = [short(launches[i]["name"]) for i in cycles[0]]
    same = [c for c in cycles if [short(launches[i]["name"]) for i in c] == shape]
    labels = [k if shape[:j].count(k) == 0 else f"{k}#{shape[:j].count(k) + 1}" for j, k in enumerate(shape)]

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else float("nan")
    return [{"kernel": labels[j], "us": median(launches[c[j]]["us"] for c in same),
             "to_next_us": median(launches[c[j + 1]]["at_us"] - launches[c[j]]["at_us"] for c in same),
             "past_end_us": median(past[c[j]] for c in same), "cycles": len(same)} for j in range(len(shape) - 1)]


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
        print(f"{r['kernel']:10s} start to next {r['to_next_us']:7.2f} us  duration {r['us']:7.2f} us  "
              f"ends past the ends before {r['past_end_us']:7.2f} us{at}")
    print(f"cycle {sum(r['to_next_us'] for r in rows):.1f} us (start to next), "
          f"{sum(r['past_end_us'] for r in rows):.1f} us (ends past the ends before)")


if __name__ == "__main__":
    main(sys.argv[1:])
