"""Time to first token of one long prompt: dense prefill against flashprefill_v2
(block-sparse prefill attention), on one GPU, in one process.

Llama-3.1-8B shape, dummy bf16 weights, one prompt of 32K / 64K / 128K tokens (--lengths),
the same token ids for both lanes. Per length: the dense lane (prefill_sparse_method none)
and the sparse lane (flashprefill_v2, --threshold; Llama-3.1-8B has no tuned threshold),
each a warm-up run, then --repeats timed runs of ``generate(max_tokens=1)`` with the device
synchronised at both ends; then one more sparse run that measures the relative L2 error of
every layer's attention output against dense attention on the same q and cache (it runs
the dense Triton prefill beside the block-sparse one, so it is not timed).

Prefill policy: both lanes use sparse_method vanilla, whose registry policy is
all_chunked (long_bs1full_short_batch is refused for it); the chunk is the whole prompt by
default (prefill_chunk_size = max_num_batched_tokens = the longest length), so each prompt
is prefilled in one pass: flashprefill_v2 then estimates one mask per layer from the
prompt's last probe blocks (its whole-prompt definition), and dense prefill is one pass
too. The KV pool holds exactly one request of the longest length, so the rest of the GPU is
free for the activations of a 128K-token pass (~20 GB) and the mask estimate (~7 GB).

Dummy (random) weights make attention close to uniform: the estimated mass of a key block
is then about 1 / (number of blocks), so the threshold keeps (almost) every block up to
some length and (almost) none past it. The block fraction printed beside each time is
what the sparse lane really computed; read the times with it.

Writes one JSON line per run (with the full engine config) to --out (.jsonl) and the same
rows, without the config, to the .csv beside it.

    python scripts/bench_ttft_128k.py --lengths 32768,65536,131072 --out results/ttft_128k.jsonl --commit abc1234
    # CPU smoke test of the script itself (interpreted Triton, tiny shape):
    TRITON_INTERPRET=1 python scripts/bench_ttft_128k.py --model tiny-llama --lengths 300 \\
        --block 16 --min-len 0 --threshold 0.05 --out /tmp/ttft.jsonl
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from sparseengine import LLM, SamplingParams
from sparseengine import kernels

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def git(*args: str) -> str:
    try:
        return subprocess.check_output(["git", *args], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return ""


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(args, sparse: bool, max_len: int) -> LLM:
    cuda = torch.cuda.is_available()
    chunk = args.prefill_chunk_size or max_len
    kw = dict(load_format="dummy", dtype="bfloat16" if cuda else "float32", attention_provider="triton",
              enforce_eager=True, max_num_seqs=1, max_model_len=max_len + 16, page_size=args.page_size,
              num_kv_pages=-(-(max_len + 16) // args.page_size) + 1, prefill_chunk_size=chunk,
              max_num_batched_tokens=chunk, seed=args.seed)
    if sparse:
        kw.update(prefill_sparse_method="flashprefill_v2", flashprefill_threshold=args.threshold)
        for name in ("block", "sink_blocks", "window_blocks", "probe_blocks", "min_len"):
            if getattr(args, name) is not None:
                kw[f"flashprefill_{name}"] = getattr(args, name)
    return LLM(args.model, **kw)


def timed_first_token(llm: LLM, prompt: list[int]):
    sync()
    t0 = time.perf_counter()
    out = llm.generate(prompt, FIRST_TOKEN)[0]
    sync()
    if out.finish_reason == "error":
        raise RuntimeError(f"request failed: {out.error}")
    return time.perf_counter() - t0, out


class DenseBeside:
    """While active, every provider call that carries a block mask also runs the dense
    Triton paged prefill on the same q and cache; per call it keeps the squared L2 norm
    of (sparse - dense) and of dense, over all rows, heads and channels (float32)."""

    def __init__(self, llm: LLM) -> None:
        self.provider = llm.provider
        self.attend = self.provider.attend
        self.sums: list[torch.Tensor] = []

    def __enter__(self) -> "DenseBeside":
        self.provider.attend = self._attend
        return self

    def __exit__(self, *exc) -> None:
        del self.provider.attend  # back to the class's method

    def _attend(self, q, k_cache, v_cache, ctx, view, selection, score_rows, block_mask=None):
        extra = {} if block_mask is None else {"block_mask": block_mask}
        out, colsums = self.attend(q, k_cache, v_cache, ctx, view, selection, score_rows, **extra)
        if block_mask is not None:
            dense = kernels.paged_prefill_triton(q, k_cache, v_cache, view.page_table, view.kv_lens,
                                                 ctx.cu_q_lens, max_q_len=max(ctx.q_lens)).float()
            self.sums.append(torch.stack([(out.float() - dense).pow(2).sum(), dense.pow(2).sum()]))
        return out, colsums

    def errors(self) -> tuple[float, float, list[float]]:
        """-> (relative L2 error over every call, the worst call's, each call's)."""
        sums = torch.stack(self.sums).double().cpu() if self.sums else torch.zeros(0, 2, dtype=torch.float64)
        per_call = [math.sqrt(e / r) if r > 0 else 0.0 for e, r in sums.tolist()]
        total_err, total_ref = (float(x) for x in sums.sum(0)) if self.sums else (0.0, 0.0)
        return (math.sqrt(total_err / total_ref) if total_ref > 0 else 0.0, max(per_call, default=0.0), per_call)


def provenance(args, llm: LLM) -> dict:
    cuda = torch.cuda.is_available()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    return {"model": args.model, "dtype": str(llm.dtype).removeprefix("torch."), "load_format": "dummy",
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu", "gpus": 1 if cuda else 0,
            "commit": args.commit or git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "torch": torch.__version__, "cuda": torch.version.cuda or "", "triton": triton_version,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def lane_fields(llm: LLM, prompt_len: int) -> dict:
    cfg = llm.config
    row = {"prefill_sparse_method": cfg.prefill_sparse_method, "sparse_method": cfg.sparse_method,
           "prefill_policy": llm.prefill_policy, "prefill_chunk_size": cfg.prefill_chunk_size,
           "max_num_batched_tokens": cfg.max_num_batched_tokens,
           "prefill_passes": -(-prompt_len // min(cfg.prefill_chunk_size, cfg.max_num_batched_tokens)),
           "page_size": cfg.page_size, "provider": llm.provider.name, "cuda_graphs": False}
    if cfg.prefill_sparse_method == "flashprefill_v2":
        fp = llm.method.parts[0]
        row.update(flashprefill_threshold=fp.threshold, flashprefill_block=fp.block,
                   flashprefill_sink_blocks=fp.sink_blocks, flashprefill_window_blocks=fp.window_blocks,
                   flashprefill_probe_blocks=fp.probe_blocks, flashprefill_min_len=fp.min_len)
    return row


def block_stats(llm: LLM, request_id: int) -> dict:
    if llm.config.prefill_sparse_method != "flashprefill_v2":
        return {"block_fraction": 1.0}
    st = llm.method.parts[0].request_stats(request_id)
    return {"block_fraction": round(st["block_fraction"], 6), "blocks_computed": st["blocks_computed"],
            "blocks_total": st["blocks_total"], "sparse": st["sparse"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="131072", help="prompt lengths, e.g. 32768,65536,131072")
    ap.add_argument("--out", default="results/ttft_128k.jsonl")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--threshold", type=float, default=0.002, help="flashprefill_threshold (none is tuned for "
                    "this model)")
    ap.add_argument("--block", type=int, default=None, help="flashprefill_block (registry default 128)")
    ap.add_argument("--sink-blocks", dest="sink_blocks", type=int, default=None)
    ap.add_argument("--window-blocks", dest="window_blocks", type=int, default=None)
    ap.add_argument("--probe-blocks", dest="probe_blocks", type=int, default=None)
    ap.add_argument("--min-len", dest="min_len", type=int, default=None, help="flashprefill_min_len")
    ap.add_argument("--prefill-chunk-size", type=int, default=0, help="0: the longest length (one pass)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per lane and length (after a warm-up)")
    ap.add_argument("--no-error", action="store_true", help="skip the attention-error runs")
    ap.add_argument("--wall-budget-s", type=float, default=400, help="start no new run once this old")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default="", help="commit to record where the tree has no .git")
    args = ap.parse_args()
    lengths = sorted(int(x) for x in args.lengths.split(","))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    jsonl, csv_path = out.with_suffix(".jsonl"), out.with_suffix(".csv")
    rows: list[dict] = []

    def write(row: dict) -> None:
        rows.append(row)
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        flat = [{k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in r.items() if k != "config"}
                for r in rows]
        keys = list(dict.fromkeys(k for r in flat for k in r))
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(flat)

    started = time.time()
    lanes = {"dense": build(args, False, lengths[-1]), "flashprefill_v2": build(args, True, lengths[-1])}
    vocab = lanes["dense"].model_config.vocab_size
    print(f"built both lanes in {time.time() - started:.1f} s; NOTE: dummy weights -> near-uniform attention, "
          "so the sparse lane's block fraction depends on length and threshold (printed with each time)", flush=True)
    ttft_dense: dict[int, float] = {}
    summary = []
    for n in lengths:
        prompt = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(args.seed + n)).tolist()
        for lane, llm in lanes.items():
            base = {"kind": "ttft", "lane": lane, "prompt_len": n, "output_len": 1, "batch": 1,
                    **lane_fields(llm, n), **provenance(args, llm)}
            if time.time() - started > args.wall_budget_s:
                print(f"{lane} {n}: skipped, the wall budget is spent", flush=True)
                write({**base, "status": "not_run", "error": "wall budget spent"})
                continue
            try:
                warmup_s, _ = timed_first_token(llm, prompt)
                times, stats, engine_ttft = [], {}, None
                for _ in range(args.repeats):
                    s, res = timed_first_token(llm, prompt)
                    times.append(s)
                    stats, engine_ttft = block_stats(llm, res.request_id), res.metrics["ttft_s"]
            except Exception as exc:  # record and go on: a failure must not lose the other rows
                print(f"{lane} {n} FAILED: {type(exc).__name__}: {exc}", flush=True)
                write({**base, "status": "failed", "error": f"{type(exc).__name__}: {exc}"})
                continue
            ttft = statistics.median(times)
            row = {**base, "status": "ok", "ttft_s": round(ttft, 4), "ttft_runs_s": [round(t, 4) for t in times],
                   "warmup_s": round(warmup_s, 4), "engine_ttft_s": round(engine_ttft, 4), **stats}
            if lane == "dense":
                ttft_dense[n] = ttft
            elif n in ttft_dense:
                row["ttft_dense_s"] = round(ttft_dense[n], 4)
                row["ttft_ratio_sparse_over_dense"] = round(ttft / ttft_dense[n], 4)
            write({**row, "config": llm.config.to_dict()})
            print(f"{lane:>16} {n:7d} tokens: TTFT {ttft:8.3f} s (warm-up {warmup_s:.3f} s)  "
                  f"block fraction {row['block_fraction']:.4f}"
                  + (f"  ratio sparse/dense {row['ttft_ratio_sparse_over_dense']:.3f}"
                     if "ttft_ratio_sparse_over_dense" in row else ""), flush=True)
            if lane != "dense":
                summary.append([n, ttft_dense.get(n), ttft, row["block_fraction"], None])
        if args.no_error:
            continue
        llm = lanes["flashprefill_v2"]
        base = {"kind": "attn_error", "lane": "flashprefill_v2", "prompt_len": n, **lane_fields(llm, n),
                **provenance(args, llm),
                "error_method": "dense Triton paged prefill beside the block-sparse one on the same q and cache, "
                                "every layer; relative L2 over rows, heads and channels (bf16 outputs, fp32 sums)"}
        if time.time() - started > args.wall_budget_s:
            print(f"error {n}: skipped, the wall budget is spent", flush=True)
            write({**base, "status": "not_run", "error": "wall budget spent"})
            continue
        try:
            t0 = time.perf_counter()
            with DenseBeside(llm) as meas:
                _, res = timed_first_token(llm, prompt)
            rel, worst, per_call = meas.errors()
        except Exception as exc:
            print(f"error {n} FAILED: {type(exc).__name__}: {exc}", flush=True)
            write({**base, "status": "failed", "error": f"{type(exc).__name__}: {exc}"})
            continue
        row = {**base, "status": "ok", "attn_rel_error": round(rel, 6), "attn_max_rel_error": round(worst, 6),
               "attn_rel_error_per_layer": [round(e, 6) for e in per_call], **block_stats(llm, res.request_id),
               "run_s": round(time.perf_counter() - t0, 3)}
        write({**row, "config": llm.config.to_dict()})
        print(f"{'error':>16} {n:7d} tokens: attention rel. L2 error vs dense {rel:.4%} (worst layer {worst:.4%}), "
              f"block fraction {row['block_fraction']:.4f}", flush=True)
        for s in summary:
            if s[0] == n:
                s[4] = rel
    for llm in lanes.values():
        llm.close()
    print("\nprompt   dense TTFT   sparse TTFT   sparse/dense   block fraction   attn rel. error")
    for n, dense, sparse, frac, err in summary:
        ratio = f"{sparse / dense:12.3f}" if dense else f"{'-':>12}"
        print(f"{n:6d} {dense if dense else float('nan'):10.3f} s {sparse:11.3f} s {ratio}   {frac:14.4f}   "
              + (f"{err:.4%}" if err is not None else "-"))
    print(f"total {time.time() - started:.1f} s; rows in {jsonl} and {csv_path}", flush=True)


if __name__ == "__main__":
    main()
