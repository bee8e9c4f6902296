"""Issue-3 measurement: every method on SmolLM2 (CPU) at total budgets of 1/8, 1/4 and 1/2
of the context, on passkey prompts of 2K and 4K tokens (needle at 50% depth).

Per (method, context, budget): passkey retrieval rate, top-1 agreement with vanilla (the
fraction of greedy output positions whose token equals vanilla's at the same position,
over the generated continuation), and the KV actually held at the end (tokens per layer
and KV head, and bytes against dense).

    python scripts/cpu_methods_smollm2.py --out results/cpu_methods_smollm2.csv [--deltakv-checkpoint P]
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import time
from pathlib import Path

from tqdm.auto import tqdm

from sparseengine import LLM, SamplingParams
from sparseengine.method_registry import decode_methods

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEYS = (68241, 13579, 90210, 45126)


def passkey_prompt(tok, n_tokens: int, key: int) -> list[int]:
    filler = tok.encode(FILLER, add_special_tokens=False)
    body = filler * (n_tokens // len(filler) + 2)
    needle = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False)
    question = tok.encode(" What is the pass key? The pass key is", add_special_tokens=False)
    room = n_tokens - len(needle) - len(question)
    return body[: room // 2] + needle + body[room // 2: room] + question


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/cpu_methods_smollm2.csv")
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--deltakv-checkpoint", default="")
    ap.add_argument("--fractions", default="8,4,2", help="total = context / f for each f")
    ap.add_argument("--append", action="store_true", help="keep the rows already in --out")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = list(csv.DictReader(open(args.out))) if args.append and Path(args.out).exists() else []
    base = LLM(dtype="float32")
    tok, folder = base.tokenizer, "smollm2-135m-instruct"
    kv_per_token = 2 * base.model_config.num_layers * base.model_config.num_kv_heads * base.model_config.head_dim * 4
    base.close()
    methods = [m for m in decode_methods() if m != "deltakv" or args.deltakv_checkpoint]
    contexts, fractions = map(int, args.contexts.split(",")), [int(f) for f in args.fractions.split(",")]
    jobs = [(ctx, frac, m) for ctx in contexts for frac in fractions for m in methods]
    refs: dict[int, list[list[int]]] = {}
    for ctx, frac, method in tqdm(jobs, desc="methods x budgets"):
        prompts = [passkey_prompt(tok, ctx, k) for k in KEYS[: args.prompts]]
        if ctx not in refs:
            with LLM(folder, dtype="float32", max_model_len=8192) as llm:
                refs[ctx] = [o.token_ids for o in llm.generate(prompts, params)]
        total = ctx // frac
        sink, recent = 16, max(32, total // 8)
        knobs = dict(sink_tokens=sink, recent_tokens=recent, budget=total - sink - recent)
        if method == "deltakv":
            knobs.update(deltakv_checkpoint_path=args.deltakv_checkpoint)
        t0 = time.perf_counter()
        with LLM(folder, dtype="float32", sparse_method=method, max_model_len=8192, **knobs) as llm:
            outs = llm.generate(prompts, params)
            peak = llm.peak_pages_used
        secs = time.perf_counter() - t0
        found = [str(k) in o.text for k, o in zip(KEYS, outs)]
        agree = [sum(a == b for a, b in zip(o.token_ids, r)) / len(r) for o, r in zip(outs, refs[ctx])]
        kv = [o.metrics["kv_tokens"] for o in outs]
        rows.append({"method": method, "context": ctx, "budget_fraction": f"1/{frac}", "total_attended": total,
                     "sink_tokens": sink, "recent_tokens": recent, "budget": total - sink - recent,
                     "prompts": len(prompts), "passkey_rate": sum(found) / len(found),
                     "top1_agreement_vs_vanilla": round(sum(agree) / len(agree), 4),
                     "kv_tokens_per_layer_head_end": round(sum(kv) / len(kv), 1),
                     "kv_bytes_held_end": int(sum(kv) / len(kv) * kv_per_token),
                     "kv_fraction_of_dense_end": round(sum(kv) / len(kv) / (ctx + args.new_tokens - 1), 4),
                     "peak_pages_used": peak, "seconds": round(secs, 1), "model": "smollm2-135m-instruct",
                     "dtype": "float32", "new_tokens": args.new_tokens, "commit": commit})
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    for r in rows:
        print(f"{int(r['context']):5d} {r['budget_fraction']:>4} {r['method']:>13} "
              f"passkey {float(r['passkey_rate']):.2f} agree {float(r['top1_agreement_vs_vanilla']):.2f} "
              f"kv {float(r['kv_fraction_of_dense_end']):.2f}")


if __name__ == "__main__":
    main()
