"""Where does OmniKV's CUDA pick (`omnikv_select.cu`) spend its time? Alone at the 128K
benchmark's shape it took 23.7 us a launch on an H100 (scores in L2), in the b=3 decode step
31.6 (scores in DRAM, written by the filter layer's attention; session 61, s61-2).

Times patched copies of the kernel's source (built with nvcc in a temporary folder), each
returning after a later stage (every CTA of a cluster returns together, past a cluster
barrier where the cluster's shared memory was read):
- `entry`: returns at once (the launch's floor: a grid of clusters of 16 CTAs of 1024 threads);
- `load`: + the request's length, the page entries and the scores as keys in shared memory;
- `pass1` .. `pass4`: + that many radix passes (each: a histogram, a cluster barrier, the
  cluster's histograms summed through distributed shared memory, the byte settled);
- `count`: + the block scan and the earlier CTAs' totals;
- `full`: the kernel as it is (+ the chosen tokens and pool rows written); its choice is checked
  against the Triton pick's.
Each per launch in a CUDA graph of 30 (`bench_common.per_launch_us`): `us_l2`, launches back to
back (the scores stay in L2), and `us_dram`, each launch after a 128 MB memset that evicts them
(the memset's own time, timed alone in the same way, subtracted).

    python scripts/probe_omnikv_pick_stages.py OUT.jsonl [--batch B]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparseengine.kernels import nvcc_build, omnikv_select_cuda  # noqa: E402

KERNELS = Path(omnikv_select_cuda.__file__).parent
SOURCE = "omnikv_select.cu"
# Where each stage ends in the source (each must match once), and what returns there: a use of the stage's result
# (so the compiler keeps it), after the cluster barrier the stages from the passes on need.
ENTRY = "  const int rank = (int)cluster.block_rank(), b = blockIdx.x / CL, tid = threadIdx.x;\n"
LOADED = "  load_keys(a, a.scores + b * a.sb + base, lo, len, n, base, keys, hi);\n"
PASSED = "  const unsigned t = prefix;\n"
COUNTED = "  cluster_arrive();  // done with the cluster's shared memory"
PASSES = "constexpr int PASSES = 4;"


def _stop(use: str, barrier: bool) -> str:
    sync = "    cluster_arrive();\n    cluster_wait();\n" if barrier else ""
    return f"  if (a.L > 0) {{  // probe\n{sync}    if (tid == 0 && ({use})) a.counts[b] = -7;\n    return;\n  }}\n"


def _replace(text: str, old: str, new: str) -> str:
    return nvcc_build.patch_once(text, old, new, SOURCE)


def variants() -> dict[str, str]:
    src = (KERNELS / SOURCE).read_text()
    out = {"entry": _replace(src, ENTRY, ENTRY + _stop("rank == 99", False)),
           "load": _replace(src, LOADED, LOADED + "  __syncthreads();\n" + _stop("keys[0] == 0x12345u", False))}
    for k in range(1, 5):
        cut = _replace(src, PASSED, _stop("prefix == 0x12345u", True) + PASSED)
        out[f"pass{k}"] = _replace(cut, PASSES, f"constexpr int PASSES = {k};")
    out["count"] = _replace(src, COUNTED, _stop("s.before.x + pre.x == -1", True) + COUNTED)
    out["full"] = src
    return out


def build(name: str, text: str, tmp: Path):
    source = nvcc_build.patched_copy(KERNELS / SOURCE, {SOURCE: text}, tmp / name)
    return nvcc_build.load_library(source, [], f"libprobe_{name}.so", omnikv_select_cuda.SIGNATURES, f"probe {name}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=6)
    args = ap.parse_args(argv)
    from sparseengine.kernels import omnikv_select_triton
    from sparseengine.kernels.bench_common import per_launch_us

    B, L, n, sink, budget, recent, ps = args.batch, 133120, 131072, 64, 1472, 512, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(B, 1, L, generator=gen, device="cuda")  # the folded scores a filter layer hands over
    kv_lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    table = torch.randperm(B * (L // ps), device="cuda").view(B, -1).int()
    want = omnikv_select_triton(scores, kv_lens, sink, budget, recent, page_table=table, page_size=ps)
    flush = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    evict = flush.zero_
    flush_us = per_launch_us(evict)
    original = omnikv_select_cuda.library
    with tempfile.TemporaryDirectory() as tmp, open(args.out, "a") as out:
        for name, text in variants().items():
            lib = build(name, text, Path(tmp))
            omnikv_select_cuda.library = lambda lib=lib: lib
            try:
                pick = lambda: omnikv_select_cuda.omnikv_select_cuda(  # noqa: E731
                    scores, kv_lens, sink, budget, recent, page_table=table, page_size=ps, pdl=False, trigger=False)
                same = all(torch.equal(g, w) for g, w in zip(pick(), want)) if name == "full" else None
                row = {"kind": "omnikv_pick_stage", "stage": name, "batch": B, "width": L, "kv_len": n,
                       "us_l2": per_launch_us(pick), "us_dram": per_launch_us(lambda: (evict(), pick())) - flush_us,
                       "flush_us": flush_us, "equals_triton_pick": same}
            finally:
                omnikv_select_cuda.library = original
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
