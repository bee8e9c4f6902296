"""The fused decode MLP (`kernels/fused_mlp.py`) on grids of several programs an SM: its
persistent programs wait on each other's tiles, so every program must be resident at once;
each configuration runs in a child process under a time limit, so one that is not (a hang)
costs only itself. Per launch in a CUDA graph, 6 rows, the Llama-3.1-8B MLP, beside the
engine's three launches (`bench_linear.bench_fused_mlp`'s cycling weights).

    python scripts/probe_fused_mlp_grid.py OUT.jsonl
"""
from __future__ import annotations

import json
import subprocess
import sys

# (block_n, block_n2, block_k, num_stages, chunks, programs an SM, spin: 0 acquire atomics, 1 volatile loads,
# 2 volatile loads and nanosleep)
CONFIGS = [(32, 32, 256, 5, 2, 1, 1), (32, 32, 256, 5, 2, 1, 2), (64, 32, 256, 3, 2, 1, 1), (64, 32, 256, 3, 2, 1, 2),
           (32, 32, 256, 3, 2, 2, 2), (32, 32, 256, 5, 1, 1, 2), (32, 32, 256, 5, 4, 1, 2), (32, 32, 256, 5, 2, 1, 0)]
CHILD = """
import json, sys, torch
from sparseengine.kernels import bench_linear
from sparseengine.kernels._common import num_sms
bn, bn2, bk, st, ch, per_sm, spin = json.loads(sys.argv[1])
bench_linear.FUSED_MLP_CONFIGS = [dict(block_n=bn, block_n2=bn2, block_k=bk, num_stages=st, chunks=ch, spin=spin,
                                       programs=per_sm * num_sms(torch.device("cuda")))]
bench_linear.bench_fused_mlp(sys.argv[2], rows=(6,), with_unfused=sys.argv[3] == "1")
"""


def main() -> None:
    out = sys.argv[1]
    for i, cfg in enumerate(CONFIGS):
        try:
            subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), out, "1" if i == 0 else "0"], timeout=90,
                           check=False)
        except subprocess.TimeoutExpired:
            with open(out, "a") as f:
                f.write(json.dumps({"kind": "fused_mlp", "config": cfg, "error": "timed out (90 s): a hang"}) + "\n")


if __name__ == "__main__":
    main()
