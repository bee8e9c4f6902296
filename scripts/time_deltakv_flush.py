"""How long do DeltaKV's history flushes take? (they run eagerly after a decode step, every
64 steps per request, outside the CUDA graph the step replays)

Builds the engine on a model shape with dummy weights, synthesises the prefill of
``--batch`` requests of ``--prompt-len`` tokens (their codecs hold random histories of the
right sizes), decodes ``--tokens`` tokens, and times every flush that moves tokens into a
history, the device synchronised before and after. Writes one JSON: each flush's
milliseconds, the decode's wall time, and what ran.

    python scripts/time_deltakv_flush.py --engine-arg deltakv_checkpoint_path=FILE --out flush_b1.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from profile_decode_step import _engine_arg  # scripts/, on the path when run as a script

from sparseengine import LLM, SamplingParams


def _device_us(e) -> float:
    return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))


def top_ops(prof, rows: int = 25) -> list[dict]:
    """The profiled flush's ops, most host time first: calls, host us (self), device us (self)."""
    out = []
    for e in prof.key_averages():
        device_us = _device_us(e)
        out.append({"op": e.key[:120], "calls": e.count, "host_us": round(e.self_cpu_time_total, 1),
                    "device_us": round(device_us, 1)})
    return sorted(out, key=lambda r: -r["host_us"])[:rows] + sorted(out, key=lambda r: -r["device_us"])[:rows]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=131072)
    ap.add_argument("--tokens", type=int, default=200, help="decode tokens (a flush every 64 per request)")
    ap.add_argument("--total", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--engine-arg", action="append", type=_engine_arg, default=[], metavar="KEY=VALUE",
                    help="another LLM(...) argument, e.g. deltakv_checkpoint_path=FILE (repeatable)")
    ap.add_argument("--profile", type=int, default=0,
                    help="also profile the N-th timed flush (torch.profiler): its top ops by host and device time")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    kw = dict(model=args.model, load_format="dummy", dtype=args.dtype, device=args.device, sparse_method="deltakv",
              max_num_seqs=max(8, args.batch), sink_tokens=64, recent_tokens=512, budget=args.total - 576,
              max_model_len=args.prompt_len + args.tokens + 64, **dict(args.engine_arg))
    prompts = [[(7 * i + j) % 30000 + 3 for j in range(args.prompt_len)] for i in range(args.batch)]
    with LLM(**kw) as llm:
        rt = llm.method
        flush, times, ops = rt._flush, [], {}

        def timed(seq):
            before = rt._state(seq).hist_end
            sync(args.device)
            start = time.perf_counter()
            if args.profile and len(times) + 1 == args.profile:
                with torch.profiler.profile() as prof:
                    flush(seq)
                    sync(args.device)
                ops["profile"] = top_ops(prof)
                ops["profile_device_us"] = round(sum(_device_us(e) for e in prof.key_averages()), 1)
            else:
                flush(seq)
            sync(args.device)
            if rt._state(seq).hist_end != before:
                times.append(1e3 * (time.perf_counter() - start))

        rt._flush = timed
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True),
                            prefill="synthesized")
        wall = time.perf_counter() - start
    out = {"model": args.model, "batch": args.batch, "prompt_len": args.prompt_len, "tokens": args.tokens,
           "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
           "commit": args.commit, "torch": torch.__version__, "flush_ms": [round(t, 2) for t in times],
           "generate_s": round(wall, 3), "generated": [len(o.token_ids) for o in outs], **ops}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
