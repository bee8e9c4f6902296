"""Issue-2 benchmark: the engine against Hugging Face ``generate`` on the CPU, side by side.

8 prompts of 512 tokens, 64 new tokens each, batch 8, SmolLM2-135M float32, greedy.
Writes one CSV row per lane with the commit and machine, and prints the ratio.

    python scripts/bench_cpu_engine_vs_hf.py --out results/cpu_engine_vs_hf.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def provenance() -> dict:
    def git(*args):
        try:
            return subprocess.check_output(["git", *args], text=True, stderr=subprocess.DEVNULL).strip()
        except Exception:
            return ""
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "machine": f"{platform.processor() or platform.machine()} x{os.cpu_count()} ({platform.node()})",
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def prompts_of(tokenizer, n: int, length: int) -> list[list[int]]:
    text = Path(__file__).read_text() * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [ids[i * 37: i * 37 + length] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/cpu_engine_vs_hf.csv")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, GenerationConfig

    from sparseengine import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    prompts = prompts_of(llm.tokenizer, args.batch, args.prompt_len)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate([p[:16] for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=2))  # warm-up

    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    engine_total = time.perf_counter() - t0
    first = min(o.metrics["ttft_s"] for o in outs)
    engine_prefill = max(o.metrics["ttft_s"] for o in outs)
    engine_decode = engine_total - engine_prefill
    del first

    hf = AutoModelForCausalLM.from_pretrained(str(llm.source.folder), dtype=torch.float32).eval()
    hf.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hf.generate(ids[:2, :16], attention_mask=mask[:2, :16], max_new_tokens=2)  # warm-up
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=1)
        hf_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf_out = hf.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens)
        hf_total = time.perf_counter() - t0
    hf_decode = hf_total - hf_prefill
    same = sum(o.token_ids == hf_out[i, args.prompt_len:].tolist() for i, o in enumerate(outs))

    decode_tokens = args.batch * (args.new_tokens - 1)
    rows = []
    for lane, total, prefill, decode in (("sparseengine", engine_total, engine_prefill, engine_decode),
                                         ("hf_generate", hf_total, hf_prefill, hf_decode)):
        rows.append({"lane": lane, "batch": args.batch, "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "dtype": "float32", "model": "smollm2-135m-instruct",
                     "total_s": round(total, 3), "prefill_s": round(prefill, 3), "decode_s": round(decode, 3),
                     "decode_tok_s": round(decode_tokens / decode, 2),
                     "e2e_tok_s": round(args.batch * args.new_tokens / total, 2),
                     "outputs_identical_to_hf": f"{same}/{args.batch}", **provenance()})
    ratio = rows[0]["decode_tok_s"] / rows[1]["decode_tok_s"]
    for r in rows:
        r["decode_ratio_engine_over_hf"] = round(ratio, 3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"{r['lane']:>13}: decode {r['decode_tok_s']:8.1f} tok/s  e2e {r['e2e_tok_s']:8.1f} tok/s  "
              f"prefill {r['prefill_s']:.2f}s")
    print(f"engine / HF decode tok/s = {ratio:.2f}x; identical outputs {same}/{args.batch}")
    llm.close()


if __name__ == "__main__":
    main()
