"""Does a GEMV written in CUDA, launched as a programmatic dependent launch (PDL), win back
what the decode step's Triton linears lose at kernel boundaries? (scripts/cuda_gemv.cu)

The linears are about half of Quest's and OmniKV's b=6 step at 128K and read their 15 GB
at ~3.76 TB/s where the copy bandwidth is ~4.2: about 3.4 us a launch goes to each
kernel's ramp and tail (results/README.md). Triton's PDL launches made the chain slower
(`pdl_chain_h200.jsonl`). This probe builds the CUDA kernel with nvcc, checks it against
torch at every linear shape, then times, in one CUDA graph each:
- each linear alone, cycling over weight copies (no weight in L2): CUDA beside the
  engine's Triton launch (`bench_linear.engine_variants`);
- the same on the tensor cores (`mma`: mma.sync, 16 weight rows a CTA at a time, its warps
  splitting K);
- the step's chain (`bench_linear.bench_pdl_chain`'s: qkv, o, gate_up, down for 32 layers
  of their own weights, a one-program-a-row stand-in kernel between each pair): the
  engine's Triton launches, each CUDA kernel, each with PDL (and stand-ins with PDL that let the next
  kernel launch at their start, or after their stores).

    python scripts/probe_cuda_gemv.py OUT.jsonl    (on the GPU; needs nvcc: CUDA_HOME or PATH)
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from sparseengine.kernels.bench_common import BF16, emit, per_launch_us, run_meta
from sparseengine.kernels.bench_linear import (CHAIN_CONFIGS, SHAPES, _cycling, chain_inputs, engine_variants,
                                               step_chain)

SOURCE = Path(__file__).with_name("cuda_gemv.cu")
HEADERS = Path(__file__).resolve().parents[1] / "sparseengine" / "kernels"  # launch_pdl.cuh, mma_bf16.cuh


def build() -> ctypes.CDLL:
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    lib = Path(tempfile.mkdtemp()) / "libse_gemv.so"
    cmd = [nvcc, "-O3", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-Xptxas", "-v", f"-I{HEADERS}",
           "-o", str(lib), str(SOURCE)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvcc failed:\n{done.stderr}")
    print(done.stderr[-600:], flush=True)
    so = ctypes.CDLL(str(lib))
    so.se_gemv.restype = ctypes.c_int
    so.se_gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_int]
    return so


def cuda_gemv(so, x: torch.Tensor, w: torch.Tensor, pdl: bool = False, mma: bool = False) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] bf16, launched on the current stream (`mma`: the
    tensor-core kernel)."""
    assert x.is_contiguous() and w.is_contiguous() and x.dtype == w.dtype == BF16
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty((m, n), dtype=BF16, device=x.device)
    err = so.se_gemv(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, int(pdl),
                     torch.cuda.current_stream().cuda_stream, int(mma))
    if err:
        raise RuntimeError(f"se_gemv launch failed: error {err} (M={m}, N={n}, K={k})")
    return y


def check_and_time_shapes(so, out, rows=(1, 6), min_bytes=512 << 20) -> None:
    from sparseengine.kernels.skinny_linear import skinny_linear_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in CHAIN_CONFIGS:  # qkv, o, gate_up, down
        n, k = SHAPES[name]
        copies = max(2, -(-min_bytes // (2 * n * k)))
        weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=BF16) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=BF16)
            want = F.linear(x.float(), weights[0].float())
            tri = engine_variants(n, m)[0]
            runs = {"cuda": lambda a, w: cuda_gemv(so, a, w), "cuda_mma": lambda a, w: cuda_gemv(so, a, w, mma=True),
                    "triton_engine": lambda a, w: skinny_linear_triton(a, w, **tri)}
            for impl, fn in runs.items():
                got = fn(x, weights[0]).float()
                torch.cuda.synchronize()
                err = (got - want).abs().max().item()
                rel = err / want.abs().max().item()
                us = per_launch_us(_cycling(fn, weights, x), launches=2 * copies)
                emit(out, {"kind": "cuda_gemv_shape", "layer": name, "n": n, "k": k, "rows": m, "impl": impl,
                           "us_per_launch": us, "weight_gbps": 2 * n * k / us / 1e3, "max_abs_err": err,
                           "rel_err": rel, "ok": rel < 2e-2})
        del weights
        torch.cuda.empty_cache()


def time_chains(so, out, rows=6, layers=32) -> None:
    from sparseengine.kernels.skinny_linear import skinny_linear_triton

    weights, x0 = chain_inputs(rows, layers)

    def chain(gemm, pdl, early=True):
        return step_chain(weights, x0, gemm, pdl, early)

    def triton(a, w, name):
        return skinny_linear_triton(a, w[name], **engine_variants(SHAPES[name][0], rows)[0])

    def cuda(pdl, mma=False):
        return lambda a, w, name: cuda_gemv(so, a, w[name], pdl, mma)

    variants = {"triton_engine": chain(triton, False), "cuda": chain(cuda(False), False),
                "cuda_pdl": chain(cuda(True), True), "cuda_mma": chain(cuda(False, True), False),
                "cuda_mma_pdl": chain(cuda(True, True), True),
                "cuda_mma_pdl_stand_ins_trigger_last": chain(cuda(True, True), True, False),
                "triton_engine_again": chain(triton, False)}
    nbytes = sum(t.numel() * t.element_size() for w in weights for t in w.values())
    ref = None
    for name, fn in variants.items():
        try:
            y = fn().float()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a variant that fails to launch is a result too
            emit(out, {"kind": "cuda_gemv_chain", "variant": name, "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        ref = y if ref is None else ref
        us = per_launch_us(fn, launches=1)
        emit(out, {"kind": "cuda_gemv_chain", "variant": name, "rows": rows, "layers": layers, "us_per_chain": us,
                   "weight_gbps": nbytes / us / 1e3, "weight_bytes": nbytes,
                   "rel_err_vs_triton": ((y - ref).abs().max() / ref.abs().max()).item()})


def main(out: str) -> None:
    emit(out, {"kind": "meta", **run_meta(), "command": "python scripts/probe_cuda_gemv.py " + out})
    so = build()
    check_and_time_shapes(so, out)
    time_chains(so, out)


if __name__ == "__main__":
    main(sys.argv[1])
