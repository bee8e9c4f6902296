"""How much host (Python) time one decode step costs outside the model: the engine runs its
graph-replay path with the replay stubbed out (it returns fixed logits at once), so what is
left is scheduling, building the step's inputs, sampling and bookkeeping. CPU is enough.

    python scripts/profile_host_step.py --steps 3000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparseengine import LLM, SamplingParams  # noqa: E402
from tests.conftest import make_tiny_hf_folder  # noqa: E402


class _TmpDirs:  # what make_tiny_hf_folder needs of pytest's tmp_path_factory
    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=name))


class _StubGraphs:
    """The decode-graph interface with an instant replay."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def bucket(self, batch: int) -> int:
        return batch

    def fits(self, seqs) -> bool:
        return True

    def page_tables(self, seq_ids, tables):
        """The real one's host rows: every table, zero-padded."""
        out = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
        for b, pages in enumerate(tables):
            out[b, : len(pages)] = pages
        return out

    def run(self, ids, positions, slots, lens, seqs=None, key=None) -> torch.Tensor:
        return self.logits[: len(ids)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny-llama")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    folder, _ = make_tiny_hf_folder(_TmpDirs(), args.shape)
    with LLM(str(folder), device="cpu", max_model_len=args.steps + 1100) as llm:
        logits = torch.zeros(args.batch, llm.model_config.vocab_size)
        logits[:, 5] = 1.0
        llm.runner.graphs = _StubGraphs(logits)
        params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([[3] * 1000] * args.batch, params)
        seconds = time.perf_counter() - t0
        print(f"{args.shape} batch {args.batch}: {1e3 * seconds / args.steps:.3f} ms of host time per step "
              f"({llm.runner.graph_steps} stubbed graph steps, {llm.model_config.num_layers} layers)")


if __name__ == "__main__":
    main()
