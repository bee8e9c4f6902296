"""How much host (Python) time one decode step costs outside the model: the engine runs its
graph-replay path (the real DecodeGraphs host side: page-table mirror, staged inputs) with
the capture stubbed out (the replay does nothing and returns fixed logits), so what is left
is scheduling, building the step's inputs, sampling and bookkeeping. CPU is enough; a
model of the tiny-llama widths with ``--layers`` layers and ``--prompt-len`` synthesised
prompts gives the benchmark's per-step Python work (32 layers, 128K prompts: 8192 pages a
request).

    python scripts/profile_host_step.py --layers 32 --prompt-len 131072 --batch 6 --method quest
    python scripts/profile_host_step.py --method snapkv --batch 183 --kv-gib 4 --profile --sort tottime

The stub's page table is as wide as the engine's graph table for the method (`table_pages`).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparseengine import LLM, SamplingParams  # noqa: E402
from sparseengine.engine.cuda_graphs import DecodeGraphs, table_pages  # noqa: E402
from sparseengine.models.loader import SHAPES_DIR  # noqa: E402


class _NoReplay:
    def replay(self) -> None:
        pass


class _StubGraphs(DecodeGraphs):
    """The decode graphs' host side, with captures that launch nothing."""

    def _capture(self, size, seqs=None, graph_id=None):
        logits = torch.zeros(size, self.model.config.vocab_size)
        logits[:, 5] = 1.0
        return _NoReplay(), logits


def _model_folder(layers: int, max_len: int) -> Path:
    import transformers

    cfg = json.loads((SHAPES_DIR / "tiny-llama.json").read_text())
    cfg.update(num_hidden_layers=layers, max_position_embeddings=max_len)
    folder = Path(tempfile.mkdtemp(prefix="host_step"))
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--method", default="vanilla")
    ap.add_argument("--profile", action="store_true", help="print the cProfile of the timed steps")
    ap.add_argument("--sort", default="cumulative", help="the profile's order: cumulative or tottime")
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="the KV pool (default: every prompt's full KV; an eviction method at a large batch "
                         "needs less)")
    ap.add_argument("--before-batches", default="", metavar="B1,B2,...",
                    help="first run these batches (each --before-tokens tokens) through the engine, as the "
                         "benchmark's lane runs its smaller batches before the largest")
    ap.add_argument("--before-tokens", type=int, default=304)
    args = ap.parse_args()
    max_len = args.prompt_len + args.steps + 64
    budget = {} if args.method == "vanilla" else dict(sink_tokens=64, recent_tokens=512, budget=1472)
    kv_gib = args.kv_gib or 0.7 * args.batch * args.prompt_len / 131072 * args.layers / 32 + 0.5  # tiny widths, bf16
    with LLM(str(_model_folder(args.layers, max_len)), device="cpu", dtype="bfloat16", max_model_len=max_len,
             sparse_method=args.method, kv_cache_memory=kv_gib, max_num_seqs=args.batch, **budget) as llm:
        llm.runner.graphs = _StubGraphs(llm.model, llm.kv_cache, llm.provider, llm.method, llm.device,
                                        args.batch, table_pages(llm.method, max_len, llm.config.page_size))
        for b in [int(x) for x in args.before_batches.split(",") if x]:
            llm.generate([[4] * args.prompt_len] * b,
                         SamplingParams(temperature=0, max_tokens=args.before_tokens, ignore_eos=True),
                         prefill="synthesized")
        ends, orig, prof = [], llm.step, cProfile.Profile()

        def timed():
            if len(ends) == 20 and args.profile:
                prof.enable()
            r = orig()
            ends.append(time.perf_counter())
            return r

        llm.step = timed
        llm.generate([[3] * args.prompt_len] * args.batch,
                     SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True), prefill="synthesized")
        prof.disable()
        gaps = np.diff(ends[20:]) * 1e3
        print(f"{args.layers} layers, {args.prompt_len}-token prompts, batch {args.batch}, {args.method}: host time "
              f"per decode step median {np.median(gaps):.3f} ms, mean {gaps.mean():.3f} ms "
              f"({llm.runner.graph_steps} stubbed graph steps)")
        if args.profile:
            pstats.Stats(prof).sort_stats(args.sort).print_stats(30)


if __name__ == "__main__":
    main()
