"""Where does a decode step's time go? A per-kernel breakdown on the GPU.

Builds the engine on a model shape with dummy weights, fills the KV of ``--batch``
requests of ``--prompt-len`` tokens with the synthesised prefill, then records
``--steps`` pure-decode steps under ``torch.profiler`` (eager, so every kernel is seen:
the kernels are the ones the CUDA graph replays, without the launch gaps). Writes one JSON
with the device time per step of each kernel (grouped by name), their sum, the eager and
the graph step times measured in the same process, and the roofline of the step. The
graph steps are profiled too (CUPTI sees the kernels a replay launches): graph step time
minus their kernel sum is the host work and launch gaps between kernels. Three one-kernel
graphs are captured before the window (``--captures-before``), so the window's graph runs in
the state a lane's does: from a process's fourth stream capture on, every graph kernel
launches ~0.18 us later on the H200 (results/README.md, session 23).

    python scripts/profile_decode_step.py --method vanilla --batch 1 --out profile_vanilla_b1.json
    python scripts/profile_decode_step.py --method deltakv --engine-arg deltakv_checkpoint_path=FILE \
        --host-profile --out profile_deltakv_b1.json
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import itertools
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from experiments.throughput import gpu_clocks
from experiments.throughput.length_mix import LengthMix
from sparseengine import LLM, SamplingParams


def engine_kwargs(method: str, batch: int, max_model_len: int, total: int = 2048, **more) -> dict:
    """The profiled engine's `LLM(...)` arguments: the benchmark's dummy bf16 shape, sink 64
    and recent 512, the method's budget knobs for `total` attended tokens (as the benchmark's
    total_budget; StreamingLLM: recent), then `more`."""
    from sparseengine.method_registry import split_total

    kw = dict(model="llama-3.1-8b", load_format="dummy", dtype="bfloat16", sparse_method=method,
              max_num_seqs=max(8, batch), sink_tokens=64, recent_tokens=512, max_model_len=max_model_len)
    return {**kw, **split_total(method, total, 64, 512), **more}


def prompts_of(lengths: list[int], salt: int = 7) -> list[list[int]]:
    """Deterministic token ids, one prompt a length (the synthesised prefill never reads them)."""
    return [[(salt * i + j) % 30000 + 3 for j in range(n)] for i, n in enumerate(lengths)]


def step_time(llm, prompts, steps: int, warmup: int = 8, reads: list | None = None,
              stats: dict | None = None, window: list | None = None) -> float:
    """Median seconds per pure-decode step over ``steps`` steps after ``warmup``. ``reads``:
    receives what the method runtime says a step reads per request (`batch_reads`);
    ``stats``: the steps' mean, 90th percentile and maximum (ms), the steps over 1.2x the
    median as (index after warm-up, ms) (periodic host work shows there, not in the median)
    and every step's ms in order (`series_ms`); ``window``: receives the perf_counter times
    at which the timed steps began and ended."""
    from experiments.throughput.decode_window import batch_reads

    ends, orig = [], llm.step

    def timed():
        if reads is not None and not reads and (read := batch_reads(llm, len(prompts))) is not None:
            reads.append(read)
        r = orig()  # no device sync: a step ends once it has read its tokens (asynchronous
        ends.append(time.perf_counter())  # scheduling: the previous step's), as the benchmark's window times it
        return r

    llm.step = timed
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=warmup + steps + 3, ignore_eos=True),
                     prefill="synthesized")
    finally:
        del llm.step
    timed = [b - a for a, b in zip(ends[warmup:warmup + steps], ends[warmup + 1:warmup + steps + 1])]
    if window is not None:
        window.extend((ends[warmup], ends[warmup + steps]))
    gaps = sorted(timed)
    median = gaps[len(gaps) // 2]
    if stats is not None:
        stats.update(mean_ms=1e3 * sum(gaps) / len(gaps), p90_ms=1e3 * gaps[int(0.9 * (len(gaps) - 1))],
                     max_ms=1e3 * gaps[-1],
                     slow_steps=[(i, round(1e3 * t, 3)) for i, t in enumerate(timed) if t > 1.2 * median],
                     series_ms=[round(1e3 * t, 3) for t in timed])
    return median


def _around_steps(llm, prompts, steps: int, start, stop) -> None:
    """Generate with ``start()`` called before the 4th engine step (prefill done, a few
    decode steps warmed up) and ``stop()`` after ``steps`` more, the device synchronised."""
    seen, orig = [0], llm.step

    def stepped():
        seen[0] += 1
        if seen[0] == 4:
            torch.cuda.synchronize()
            start()
        r = orig()
        if seen[0] == 3 + steps:
            torch.cuda.synchronize()
            stop()
        return r

    llm.step = stepped
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps + 6, ignore_eos=True),
                     prefill="synthesized")
    finally:
        del llm.step


def kernel_table(llm, prompts, steps: int, sequence: dict | None = None) -> dict[str, float]:
    """Device microseconds per decode step, per kernel name, over ``steps`` profiled steps.
    ``sequence`` (``{"pattern": REGEX}``): receives under ``"launches"`` the kernels whose
    name matches, in launch order, each with its median over the steps (see
    :func:`launch_sequence`)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    _around_steps(llm, prompts, steps, prof.__enter__, lambda: prof.__exit__(None, None, None))
    per_kernel: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            per_kernel[e.key[:120]] += e.device_time_total / steps
    if sequence is not None:
        sequence["launches"] = launch_sequence(prof.events(), steps, sequence["pattern"])
    return dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))


def launch_sequence(events, steps: int, pattern: str) -> list[dict] | str:
    """The device kernels matching ``pattern`` in launch order over ``steps`` equal steps:
    position i of a step (its layer, for a kernel launched once a layer) with its name, its
    median microseconds over the steps (``us``) and its median start after the step's first
    matching launch began (``at_us``; with pattern ``.`` the step's timeline, gaps
    included). A string says why not, when the matching launches do not split into
    ``steps`` equal runs."""
    import re
    import statistics

    rx = re.compile(pattern)
    runs = sorted(((e.time_range.start, e.name, e.time_range.elapsed_us()) for e in events
                   if e.device_type.name == "CUDA" and rx.search(e.name)), key=lambda r: r[0])
    if not runs or len(runs) % steps:
        return f"{len(runs)} matching launches over {steps} steps"
    per = len(runs) // steps
    out = []
    for i in range(per):
        same = [runs[s * per + i] for s in range(steps)]
        if len({name for _, name, _ in same}) != 1:
            return f"position {i} differs between steps"
        at = statistics.median(same[s][0] - runs[s * per][0] for s in range(steps))
        out.append({"name": same[0][1][:60], "us": round(statistics.median(us for _, _, us in same), 2),
                    "at_us": round(at, 2)})
    return out


def host_profile(llm, prompts, steps: int, top: int = 30) -> list[dict]:
    """cProfile of ``steps`` decode steps after a few warm-up steps: the ``top`` functions
    by cumulative time, milliseconds per step (where the host time of an eager step goes)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    _around_steps(llm, prompts, steps, prof.enable, prof.disable)
    rows = [{"function": f"{Path(fn).name}:{line}({name})", "calls_per_step": nc / steps,
             "tottime_ms_per_step": 1e3 * tt / steps, "cumtime_ms_per_step": 1e3 * ct / steps}
            for (fn, line, name), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]
    return sorted(rows, key=lambda r: -r["cumtime_ms_per_step"])[:top]


def _engine_arg(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    try:  # a number, True/False/None, ...; else the text
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _set_kernel_const(text: str) -> tuple[str, object]:
    import importlib

    target, _, value = text.partition("=")
    module, _, name = target.rpartition(".")
    mod = importlib.import_module(f"sparseengine.kernels.{module}")
    if not module or not hasattr(mod, name):
        raise SystemExit(f"--kernel-const {text!r}: sparseengine.kernels.{module} has no constant {name!r}")
    setattr(mod, name, ast.literal_eval(value))
    return target, getattr(mod, name)


def _replay_timing() -> tuple[list, Callable[[], None]]:
    """Record, around every CUDA graph replay, device events and the host time of the launch
    call; returns (records, restore)."""
    graph, orig = torch.cuda.CUDAGraph, torch.cuda.CUDAGraph.replay
    recs: list = []

    def replay(self):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        orig(self)
        recs.append((a, b, time.perf_counter() - t0, t0))
        b.record()

    graph.replay = replay
    return recs, lambda: setattr(graph, "replay", orig)


def _replay_stats(recs: list, skip: int = 10) -> dict:
    """Medians over the replays after `skip`: device ms of a graph, device idle ms from one
    graph's end to the next one's start event, host us of the launch call, host ms between
    launches; and the first two for every replay in order (`..._series`)."""
    torch.cuda.synchronize()
    recs = recs[skip:]
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    return {"replays": len(recs), "graph_device_ms": med([a.elapsed_time(b) for a, b, _, _ in recs]),
            "device_idle_between_ms": med([p[1].elapsed_time(n[0]) for p, n in zip(recs, recs[1:])]),
            "launch_host_us": med([1e6 * h for _, _, h, _ in recs]),
            "host_between_launches_ms": med([1e3 * (n[3] - p[3]) for p, n in zip(recs, recs[1:])]),
            "graph_device_ms_series": [round(a.elapsed_time(b), 3) for a, b, _, _ in recs],
            "device_idle_between_ms_series": [round(p[1].elapsed_time(n[0]), 3) for p, n in zip(recs, recs[1:])]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--method", default="vanilla")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=131072)
    ap.add_argument("--length-mix", default=None, metavar="JSON",
                    help="a ragged batch instead of --prompt-len: [[prompt tokens, count], ...] repeated over "
                         "the batch, as task.length_mix, e.g. '[[131072,1],[1024,63]]'")
    ap.add_argument("--total", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: the longest prompt + 2048, as decode_throughput_128k (128K + 2K output), "
                         "which sets the width of the decode graphs' page tables (before session 19: + 512)")
    ap.add_argument("--steps", type=int, default=20, help="profiled steps")
    ap.add_argument("--window-steps", type=int, default=64,
                    help="timed graph steps (median, mean, slow steps); the benchmark's window is 256")
    ap.add_argument("--provider", default="triton")
    ap.add_argument("--bandwidth-gbps", type=float, default=None, help="default: measured here")
    ap.add_argument("--merge-in-split-kernel", action="store_true",
                    help="split-K decode: merge the splits in the split kernel (default: a second kernel)")
    ap.add_argument("--combine-d-tile", type=int, default=None,
                    help="split-K decode's merge kernel: channels per program (0: a whole row per program)")
    ap.add_argument("--engine-arg", action="append", type=_engine_arg, default=[], metavar="KEY=VALUE",
                    help="another LLM(...) argument, e.g. deltakv_checkpoint_path=FILE (repeatable)")
    ap.add_argument("--kernel-const", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant of sparseengine.kernels for an A/B in one call, e.g. "
                         "paged_decode.WIDE_BALANCED_MERGE=False (a Python literal; repeatable)")
    ap.add_argument("--before-batches", default="", metavar="B1,B2,...",
                    help="first run these batches of the same prompts through the engine, each for --before-tokens "
                         "tokens (as the benchmark's lane runs its smaller batches before the largest in one engine)")
    ap.add_argument("--before-tokens", type=int, default=304)
    ap.add_argument("--clocks", action="store_true",
                    help="nvidia-smi samples the GPU's clocks and power through the timed window (gpu_clocks)")
    ap.add_argument("--replay-timing", action="store_true",
                    help="events around each graph replay in the window: device time of a graph, device idle between")
    ap.add_argument("--first-seq-id", type=int, default=None,
                    help="number the engine's requests from here (the synthesised KV is seeded by seed + request id)")
    ap.add_argument("--captures-before", type=int, default=3,
                    help="capture this many one-kernel CUDA graphs before the window. A process's fourth stream "
                         "capture makes every later graph kernel ~0.18 us slower on the H200 (results/README.md, "
                         "session 23); a lane's engine captures one graph per bucket (1, 2, 4, 8 up to batch 6), so "
                         "the default 3 profiles in the lane's state; 0: as profiles before session 23")
    ap.add_argument("--graph-only", action="store_true",
                    help="only the graph window: no kernel tables, no eager engine")
    ap.add_argument("--launch-sequence", default="", metavar="REGEX",
                    help="also record the graph's kernels matching REGEX one by one, in launch order "
                         "(median over the steps): e.g. each layer's attention")
    ap.add_argument("--host-profile", action="store_true",
                    help="also cProfile the eager steps: where their host time goes")
    ap.add_argument("--commit", default=os.environ.get("SPARSEENGINE_GIT_COMMIT", ""),
                    help="the commit the record names (default: SPARSEENGINE_GIT_COMMIT, as scripts/gpu_session.sh "
                         "sets it; the device copy's .git can name an older one)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from experiments.throughput import roofline
    from sparseengine.kernels import paged_decode

    paged_decode.MERGE_IN_SPLIT_KERNEL = args.merge_in_split_kernel
    if args.combine_d_tile is not None:
        paged_decode.COMBINE_D_TILE = args.combine_d_tile or None

    consts = dict(_set_kernel_const(text) for text in args.kernel_const)
    if args.first_seq_id is not None:
        from sparseengine.engine import sequence
        sequence._ids = itertools.count(args.first_seq_id)
    mix = LengthMix.parse(None if args.length_mix is None else json.loads(args.length_mix), args.prompt_len)
    lengths = mix.lengths(args.batch)
    kw = engine_kwargs(args.method, args.batch, args.max_model_len or max(lengths) + 2048, args.total,
                       model=args.model, attention_provider=args.provider, **dict(args.engine_arg))
    prompts = prompts_of(lengths)
    bw = args.bandwidth_gbps or roofline.measure_copy_bandwidth(torch.device("cuda"))
    out = {"model": args.model, "method": args.method, "batch": args.batch, "prompt_len": args.prompt_len,
           "max_model_len": kw["max_model_len"],
           "length_mix": mix.label(),
           "provider": args.provider, "device": torch.cuda.get_device_name(), "commit": args.commit,
           "torch": torch.__version__, "bandwidth_gbps": bw, "merge_in_split_kernel": args.merge_in_split_kernel,
           "combine_d_tile": paged_decode.COMBINE_D_TILE, "kernel_consts": consts}
    with LLM(**kw) as llm:
        out["engine_args"] = {k: v for k, v in args.engine_arg}
        out["async_scheduling"] = llm.async_scheduling
        for b in [int(x) for x in args.before_batches.split(",") if x]:
            llm.generate(prompts_of(mix.lengths(b), salt=11),
                         SamplingParams(temperature=0, max_tokens=args.before_tokens, ignore_eos=True),
                         prefill="synthesized")
        out["before_batches"] = args.before_batches
        held = []  # the captures stay alive through the window (dropping them would not undo the state)
        for _ in range(args.captures_before):
            x = torch.zeros(16, device="cuda")
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                x.add_(1)
            held.append((g, x))
        out["captures_before"] = args.captures_before
        out["first_seq_id"] = args.first_seq_id
        reads: list = []
        stats: dict = {}
        recs, restore = _replay_timing() if args.replay_timing else (None, None)
        window: list = []
        with gpu_clocks.ClockSampler(gpu_clocks.gpu_selector(llm.device) if args.clocks else None) as clocks:
            out["graph_step_ms"] = 1e3 * step_time(llm, prompts, args.window_steps, reads=reads, stats=stats,
                                                   window=window)
        if args.clocks:
            summary = clocks.summary(*window)
            out["gpu_clocks"] = None if summary is None else dataclasses.asdict(summary)
        if recs is not None:
            restore()
            out["replay_timing"] = _replay_stats(recs)
        out.update({f"graph_step_{k}": v for k, v in stats.items()})
        out["graph_steps_used"] = llm.runner.graph_steps > 0
        if args.graph_only:
            print(json.dumps(out, indent=1))
            Path(args.out).write_text(json.dumps(out, indent=1))
            return
        sequence = {"pattern": args.launch_sequence} if args.launch_sequence else None
        graph_table = kernel_table(llm, prompts, args.steps, sequence)  # the kernels the graph replays
        if sequence is not None:
            out["graph_launch_sequence"] = sequence
        # the KV and metadata the method's step reads (as the throughput records count them)
        cost = roofline.decode_step_cost(llm.model_config, llm.config, 2, args.batch, sum(lengths) // len(lengths),
                                         measured=reads[0] if reads else None)
        out["read_tokens_per_layer"], out["metadata_bytes_read"] = reads[0] if reads else (None, None)
        out["roofline_bytes"] = cost.bytes
        out["limit_step_ms"] = 1e3 * cost.bytes / (bw * 1e9)
    with LLM(**kw, enforce_eager=True) as llm:
        out["eager_step_ms"] = 1e3 * step_time(llm, prompts, 32)
        table = kernel_table(llm, prompts, args.steps)
        if args.host_profile:
            out["host_profile"] = host_profile(llm, prompts, args.steps)
    out["kernel_us_per_step"] = {k: round(v, 1) for k, v in table.items()}
    out["kernel_sum_ms"] = sum(table.values()) / 1e3
    out["graph_kernel_us_per_step"] = {k: round(v, 1) for k, v in graph_table.items()}
    out["graph_kernel_sum_ms"] = sum(graph_table.values()) / 1e3
    out["graph_gap_ms"] = out["graph_step_ms"] - out["graph_kernel_sum_ms"]  # host work + launch gaps
    out["pct_of_limit_graph"] = 100 * out["limit_step_ms"] / out["graph_step_ms"]
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("kernel_us_per_step") and k != "host_profile"},
                     indent=1))
    for row in out.get("host_profile", []):
        print(f"{row['cumtime_ms_per_step']:9.2f} ms cum {row['tottime_ms_per_step']:8.2f} ms own "
              f"{row['calls_per_step']:8.1f} calls  {row['function']}")
    for title, tab in (("eager", table), ("graph", graph_table)):
        print(f"-- {title} kernels, us per step")
        for name, us in list(tab.items())[:12]:
            print(f"{us:9.1f} us  {name}")


if __name__ == "__main__":
    main()
