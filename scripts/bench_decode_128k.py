"""The headline decode benchmark (BENCHMARKS.md) on one GPU, in one process.

Llama-3.1-8B shape, dummy bf16 weights, 128K-token prompts with a synthesised prefill
(the KV filled at the lengths each method holds after a real prefill), the decode-only
window (warm-up steps, then timed steps; the device syncs only at step ends because the
sampled tokens reach the host), each lane at a ladder of batches up to its largest batch
(computed from the engine's own KV pool: the next batch up does not fit), the roofline
(bytes per step against the copy bandwidth measured in this run), and the Hugging Face
`generate` lane. Writes CSV + JSON lines under --out.

    python scripts/bench_decode_128k.py --out results/decode_throughput_128k.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from sparseengine import LLM, SamplingParams

# (lane, sparse_method, knobs, batch cap or None). Budget knobs give total --total unless set.
# Lanes whose decode runs eager per-request Python (selection and per-step compaction in
# torch) are capped so the whole run fits one device call; their rows say so.
LANES = [
    ("vanilla", "vanilla", {}, None),
    ("snapkv", "snapkv", {}, None),
    ("quest", "quest", {}, None),
    ("omnikv", "omnikv", {}, None),
    ("snapkv_8192", "snapkv", {"budget": 8192 - 64 - 512}, None),  # the seed's SnapKV total
    ("pyramidkv", "pyramidkv", {}, None),
    ("streamingllm", "streamingllm", {}, 8),
    ("h2o", "h2o", {}, 4),
]


def git(*args: str) -> str:
    try:
        return subprocess.check_output(["git", *args], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return ""


def bandwidth_gbps() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); y.copy_(x); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * (2 << 30) / sorted(times)[len(times) // 2] / 1e9


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); a @ b; e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * 8192 ** 3 / sorted(times)[len(times) // 2] / 1e12


def correctness_gate() -> dict:
    """Graphs vs eager and Triton vs torch provider: same greedy tokens on a small shape."""
    prompts = [[(i * 7 + j) % 500 + 3 for j in range(n)] for i, n in enumerate((300, 77, 129))]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    res = {}
    for method in ("vanilla", "snapkv", "quest"):
        outs = {}
        for name, kw in (("torch", dict(attention_provider="torch", enforce_eager=True)),
                         ("triton_eager", dict(attention_provider="triton", enforce_eager=True)),
                         ("triton_graphs", dict(attention_provider="triton"))):
            with LLM("tiny-llama", load_format="dummy", dtype="float32", sink_tokens=8, budget=32,
                     recent_tokens=16, snapkv_window=8, num_kv_pages=256, max_num_seqs=8, **kw,
                     sparse_method=method) as llm:
                outs[name] = [o.token_ids for o in llm.generate(prompts, p)]
                if name == "triton_graphs":
                    res[f"{method}/graph_steps"] = llm.runner.graph_steps
        res[f"{method}/triton_eq_torch"] = outs["triton_eager"] == outs["torch"]
        res[f"{method}/graphs_eq_eager"] = outs["triton_graphs"] == outs["triton_eager"]
    return res


def iter_ladder(ladder: list[int]):
    """Iterate a list that may be shortened while iterating."""
    i = 0
    while i < len(ladder):
        yield ladder[i]
        i += 1


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_lane(lane, method, knobs, cap, args, bw, tflops, writer, budget_s):
    sink, recent = args.sink, args.recent
    kw = dict(sink_tokens=sink, recent_tokens=recent, budget=args.total - sink - recent)
    kw.update(knobs)
    cuda = torch.cuda.is_available()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16" if cuda else "float32", sparse_method=method,
              attention_provider="triton" if cuda else "torch", max_num_seqs=args.max_num_seqs,
              max_model_len=args.prompt_len + args.output_len + 16, gpu_memory_utilization=0.9,
              kv_cache_memory=args.cpu_kv_gib, **kw)
    mc = llm.model_config
    per_req = -(-llm.kv_tokens_needed(args.prompt_len, args.output_len) // llm.config.page_size)
    largest = min(llm.allocator.num_pages // per_req, args.max_num_seqs)
    top = min(largest, cap) if cap else largest
    ladder = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < top] + [top]
    if args.batches:  # an explicit list (e.g. vanilla's largest batch, for the same-concurrency panel)
        ladder = [b for b in map(int, args.batches.split(",")) if b <= largest]
    eager = llm.method.wants_forward_hooks([])
    weight_bytes = sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters()
                       if "embed_tokens" not in n)
    params_count = sum(p.numel() for p in llm.model.parameters())
    kv_tok_layer = 2 * mc.num_kv_heads * mc.head_dim * 2
    started = time.time()
    for batch in iter_ladder(ladder):
        steps = args.eager_timed_steps if eager else args.timed_steps
        prompts = [[(7 * i + j) % (mc.vocab_size - 3) + 3 for j in range(args.prompt_len)] for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=args.warmup_steps + steps + 2, ignore_eos=True)
        ends, orig = [], llm.step
        sample: dict = {}

        def timed():
            if len(ends) == args.warmup_steps + 1:  # read the cache state inside the window
                seqs = list(llm.scheduler.running)
                sample["read"] = sum(sum(llm.method.tokens_read(s)) for s in seqs) * kv_tok_layer
                sample["meta"] = sum(llm.method.metadata_bytes_read(s, kv_tok_layer) for s in seqs)
                sample["kv_tokens"] = sum(sum(s.layer_lens) for s in seqs) / len(seqs) / mc.num_layers
            r = orig()
            sync()
            ends.append(time.perf_counter())
            return r
        llm.step = timed
        try:
            t0 = time.perf_counter()
            llm.generate(prompts, params, prefill="synthesized")
            wall = time.perf_counter() - t0
        finally:
            del llm.step
        seconds = ends[args.warmup_steps + steps] - ends[args.warmup_steps]
        step_s = seconds / steps
        kv_read = sample["read"]
        bytes_step = weight_bytes + kv_read + sample["meta"] + batch * kv_tok_layer * mc.num_layers
        attn_flops = 4 * mc.num_heads * mc.head_dim * (kv_read / (2 * mc.num_kv_heads * mc.head_dim * 2))
        flops = 2 * params_count * batch + attn_flops
        limit = max(bytes_step / (bw * 1e9), flops / (tflops * 1e12))
        row = {"lane": lane, "sparse_method": method, "prefill_sparse_method": "none",
               "prefill_policy": llm.prefill_policy, "prefill_chunk_size": llm.config.prefill_chunk_size,
               "prefill": "synthesized", "prompt_len": args.prompt_len, "output_len_capacity": args.output_len,
               "batch": batch, "largest_batch": largest, "batch_cap": cap or "", "next_batch_fits": (largest + 1) * per_req <= llm.allocator.num_pages and largest + 1 <= args.max_num_seqs,
               "pages_per_request": per_req, "pool_pages": llm.allocator.num_pages,
               "sink_tokens": kw["sink_tokens"], "budget": kw["budget"], "recent_tokens": kw["recent_tokens"],
               "total_attended": kw["sink_tokens"] + kw["budget"] + kw["recent_tokens"],
               "warmup_steps": args.warmup_steps, "eager_method_hooks": eager, "timed_steps": steps, "step_ms": round(step_s * 1e3, 3),
               "output_tok_s": round(batch / step_s, 2), "kv_tokens_per_layer": round(sample["kv_tokens"], 1),
               "bytes_per_step_gb": round(bytes_step / 1e9, 3), "flops_per_step_t": round(flops / 1e12, 3),
               "limit_tok_s": round(batch / limit, 2), "pct_of_limit": round(limit / step_s, 4),
               "bandwidth_gbps": round(bw, 1), "matmul_tflops": round(tflops, 1),
               "provider": llm.provider.name, "cuda_graphs": llm.runner.graph_steps > 0,
               "graph_steps": llm.runner.graph_steps, "wall_s": round(wall, 2),
               "model": args.model, "dtype": str(llm.dtype).removeprefix("torch."), "load_format": "dummy",
               "device": torch.cuda.get_device_name() if cuda else "cpu", "commit": args.commit or git("rev-parse", "--short", "HEAD"),
               "dirty": bool(git("status", "--porcelain")), "torch": torch.__version__}
        writer(row)
        print(f"{lane:>13} b={batch:4d} step {row['step_ms']:8.2f} ms  {row['output_tok_s']:9.1f} tok/s  "
              f"{100 * row['pct_of_limit']:5.1f}% of limit  graphs={row['cuda_graphs']}", flush=True)
        if time.time() - started > budget_s and batch != top:
            print(f"{lane}: lane time budget spent; going straight to batch {top}", flush=True)
            ladder[:] = [b for b in ladder if b <= batch] + [top]
    llm.close()


def hf_lane(args, writer) -> None:
    """Hugging Face ``generate`` (SDPA, dynamic cache), batch 1. A logits processor stamps
    the time of every generation step; decode tok/s comes from the stamps after the first
    (which follows the prefill), so prefill time does not leak into it."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList
    from sparseengine.models.loader import SHAPES_DIR

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    cfg = LlamaConfig(**json.loads((SHAPES_DIR / "llama-3.1-8b.json").read_text()))
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = torch.randint(3, 1000, (1, args.prompt_len), device="cuda")
    stamp = Stamp()
    with torch.no_grad():
        torch.cuda.synchronize(); t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.hf_tokens + 1,
                       logits_processor=LogitsProcessorList([stamp]))
    steps = len(stamp.times) - 1
    decode = stamp.times[-1] - stamp.times[0]
    row = {"lane": "hf_generate", "sparse_method": "hf_transformers_sdpa_dynamic_cache", "batch": 1,
           "largest_batch": 1, "prompt_len": args.prompt_len, "timed_steps": steps,
           "step_ms": round(decode / steps * 1e3, 3), "output_tok_s": round(steps / decode, 2),
           "prefill_s": round(stamp.times[0] - t0, 2), "model": "llama-3.1-8b", "dtype": "bfloat16",
           "device": torch.cuda.get_device_name(), "commit": git("rev-parse", "--short", "HEAD")}
    writer(row)
    print(f"  hf_generate b=1 {row['output_tok_s']} tok/s (prefill {row['prefill_s']} s)", flush=True)
    del model
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/decode_throughput_128k.csv")
    ap.add_argument("--prompt-len", type=int, default=131072)
    ap.add_argument("--output-len", type=int, default=2048)
    ap.add_argument("--warmup-steps", type=int, default=32)
    ap.add_argument("--timed-steps", type=int, default=256)
    ap.add_argument("--eager-timed-steps", type=int, default=64)
    ap.add_argument("--wall-budget-s", type=float, default=480, help="skip lanes once the run is this old")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--lanes", default=",".join(l for l, *_ in LANES) + ",hf")
    ap.add_argument("--lane-budget-s", type=float, default=60)
    ap.add_argument("--hf-tokens", type=int, default=16)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batches", default="", help="explicit batch list instead of the ladder")
    ap.add_argument("--commit", default="", help="commit to record where the tree has no .git")
    ap.add_argument("--cpu-kv-gib", type=float, default=1.0, help="KV pool on a CPU smoke run")
    ap.add_argument("--total", type=int, default=2048, help="total attended tokens of the sparse lanes")
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--recent", type=int, default=512)
    ap.add_argument("--skip-gate", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def writer(row: dict) -> None:
        rows.append(row)
        with open(out.with_suffix(".jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)

    if not args.skip_gate:
        gate = correctness_gate()
        print("gate:", gate, flush=True)
        (out.parent / (out.stem + "_gate.json")).write_text(json.dumps(gate, indent=1))
    bw, tflops = (bandwidth_gbps(), matmul_tflops()) if torch.cuda.is_available() else (50.0, 1.0)
    print(f"copy bandwidth {bw:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    wanted = args.lanes.split(",")
    t_start = time.time()
    if "hf" in wanted and wanted.index("hf") == 0:
        hf_lane(args, writer)
    for lane, method, knobs, cap in LANES:
        if lane in wanted:
            if time.time() - t_start > args.wall_budget_s:
                print(f"{lane}: skipped, the run's wall budget is spent", flush=True)
                writer({"lane": lane, "sparse_method": method, "status": "not_run", "error": "wall budget spent"})
                continue
            try:
                run_lane(lane, method, knobs, cap, args, bw, tflops, writer, args.lane_budget_s)
            except Exception as exc:  # record and go on: one lane's failure must not lose the rest
                print(f"{lane} FAILED: {type(exc).__name__}: {exc}", flush=True)
                writer({"lane": lane, "sparse_method": method, "status": "failed", "error": f"{type(exc).__name__}: {exc}"})
            torch.cuda.empty_cache()
    if "hf" in wanted and wanted.index("hf") != 0:
        hf_lane(args, writer)


if __name__ == "__main__":
    main()
