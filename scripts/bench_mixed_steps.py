"""A prompt prefilled in chunks beside requests that are decoding (the engine's mixed
steps), with a mixed step's decode rows routed to the split-K decode
(`triton_provider.ROUTE_DECODE_ROWS`) and not, alternating in one process.

Llama-3.1-8B shape, dummy bf16 weights, the Triton provider (or `--provider flashinfer`:
routed, its prefill leaves out the decode rows). `--decoders` requests of
`--context` tokens are synthesised (their KV filled directly, as the decode benchmarks do)
and decode; then a prompt of `--prompt` tokens arrives and is prefilled in chunks of
`--chunk` tokens beside them. Each step is timed with the device synchronised at its end,
from the prompt's arrival until its prefill is done. Per run: the newcomer's time to
first token, the mixed steps' median and the decode tokens the others got meanwhile; the
pure decode steps before the arrival are timed as a reference. One JSON line per run.

    python scripts/bench_mixed_steps.py --methods vanilla,quest --out mixed_steps.jsonl --commit abc1234
    # CPU smoke test of the script itself (interpreted Triton, tiny shape):
    TRITON_INTERPRET=1 python scripts/bench_mixed_steps.py --model tiny-llama --decoders 2 --context 200 \\
        --prompt 96 --chunk 32 --rounds 1 --total 64 --sink 4 --recent 8 --steps-budget 256 --out /tmp/mixed.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sparseengine import LLM, SamplingParams
from sparseengine.attention import triton_provider
from sparseengine.engine.sequence import Sequence
from sparseengine.method_registry import split_total

FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(args, method: str) -> LLM:
    cuda = torch.cuda.is_available()
    longest = max(args.context, args.prompt) + args.steps_budget
    pages = (args.decoders * -(-(args.context + args.steps_budget) // args.page_size)
             + -(-(args.prompt + 16) // args.page_size) + 8)
    kw = dict(load_format="dummy", dtype="bfloat16" if cuda else "float32", attention_provider=args.provider,
              max_num_seqs=args.decoders + 1, max_model_len=longest, page_size=args.page_size, num_kv_pages=pages,
              prefill_chunk_size=args.chunk, max_num_batched_tokens=args.chunk + args.decoders, seed=0,
              sparse_method=method)
    kw.update(sink_tokens=args.sink, recent_tokens=args.recent,
              **split_total(method, args.total, args.sink, args.recent, f"--total {args.total} is"))
    return LLM(args.model, **kw)


def one_step(llm: LLM) -> float:
    """One engine step's seconds, the device synchronised at its end."""
    t0 = time.perf_counter()
    llm.step()
    sync()
    return time.perf_counter() - t0


def timed_steps(llm: LLM, until) -> list[float]:
    """Step until `until()`; each step's seconds."""
    times = []
    while not until():
        times.append(one_step(llm))
    return times


def run(llm: LLM, args, method: str, decoders: list[Sequence], route: bool, warmup: bool) -> dict:
    triton_provider.ROUTE_DECODE_ROWS = route
    n = args.chunk + 16 if warmup else args.prompt
    ids = torch.randint(3, llm.model_config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    before = sum(len(s.output_token_ids) for s in decoders)
    seq = Sequence(ids, FIRST, llm.model_config.num_layers, arrival_time=time.perf_counter())
    llm.scheduler.add(seq)
    mixed = timed_steps(llm, lambda: seq.num_computed_tokens >= seq.num_prompt_tokens)
    llm.sync()
    got = sum(len(s.output_token_ids) for s in decoders) - before
    timed_steps(llm, lambda: seq.finish_time is not None)  # its first token (and the release of its pages)
    decode = [one_step(llm) for _ in range(args.decode_steps)]
    return {"kind": "mixed_steps_engine", "provider": llm.provider.name, "method": method, "route_decode_rows": route,
            "warmup": warmup,
            "decoders": len(decoders), "context": args.context, "prompt": n, "chunk": args.chunk,
            "mixed_steps": len(mixed),
            "ttft_s": sum(mixed), "mixed_step_ms_median": 1e3 * statistics.median(mixed),
            "decode_tokens_during_prefill": got, "decode_step_ms_median": 1e3 * statistics.median(decode)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--methods", default="vanilla,quest")
    ap.add_argument("--provider", default="triton", choices=("triton", "flashinfer"))
    ap.add_argument("--decoders", type=int, default=5)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--total", type=int, default=2048, help="sparse methods' total budget")
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--recent", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="alternating routed / not routed runs")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--steps-budget", type=int, default=4096, help="tokens the decoders may add")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "git_commit": args.commit or None, "command": "python scripts/bench_mixed_steps.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")}
    for method in args.methods.split(","):
        llm = build(args, method)
        try:
            decoders = []
            for i in range(args.decoders):
                ids = torch.randint(3, llm.model_config.vocab_size, (args.context,),
                                    generator=torch.Generator().manual_seed(i)).tolist()
                decoding = SamplingParams(temperature=0, max_tokens=args.steps_budget, ignore_eos=True)
                seq = Sequence(ids, decoding, llm.model_config.num_layers, arrival_time=time.perf_counter())
                llm._synthesize(seq)  # the decode benchmarks' synthesised prefill
                decoders.append(seq)
            for _ in range(4):  # the decode graphs captured
                one_step(llm)
            for route in (True, False):
                run(llm, args, method, decoders, route, warmup=True)
            for _ in range(args.rounds):
                for route in (True, False):
                    row = {**meta, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                           **run(llm, args, method, decoders, route, warmup=False)}
                    print(json.dumps(row), flush=True)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
        finally:
            triton_provider.ROUTE_DECODE_ROWS = True
            llm.close()


if __name__ == "__main__":
    main()
