"""Decode-size linear layers on the GPU, each with the op before it: the fused Triton
kernels (`small_m_linear`) at several tiles beside what the model ran before, the separate
op's kernel then cuBLAS (`torch.nn.functional.linear`), on the Llama-3.1-8B shapes, bf16,
M = 1 and 6. Each timed per launch inside a CUDA graph of 32 launches that cycle through
4 copies of the weights (over 130 MB for every layer but o and qkv, whose copies together
still pass the 50 MB L2), so no launch finds its weight in L2
(`python -m sparseengine.kernels.bench_gpu --small-m-linear --out FILE`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sparseengine.kernels import fused_ops
from sparseengine.kernels import small_m_linear as sml
from sparseengine.kernels.bench_gpu import BF16, emit, per_launch_us

# layer -> (N, K, prologue)
LAYERS = {"qkv": (6144, 4096, "rms_norm"), "o": (4096, 4096, "none"), "gate_up": (28672, 4096, "rms_norm"),
          "down": (4096, 14336, "silu_mul"), "lm_head": (128256, 4096, "none")}
TILES = [dict(block_n=32, block_k=256, num_stages=4), dict(block_n=64, block_k=128, num_stages=5),
         dict(block_n=32, block_k=512, num_stages=3), dict(block_n=16, block_k=256, num_stages=4),
         dict(block_n=64, block_k=256, num_stages=3), dict(block_n=32, block_k=128, num_stages=6)]
COPIES = 4


def _separate(prologue, x, residual, norm_w, w):
    if prologue == "rms_norm":
        return F.linear(fused_ops.add_rms_norm_triton(x, residual, norm_w, 1e-5)[0], w)
    if prologue == "silu_mul":
        return F.linear(fused_ops.silu_mul_triton(x), w)
    return F.linear(x, w)


def _fused(prologue, x, residual, norm_w, w, tile):
    if prologue == "rms_norm":
        return sml.rms_norm_linear_triton(x, residual, norm_w, 1e-5, w, **tile)[0]
    if prologue == "silu_mul":
        return sml.silu_mul_linear_triton(x, w, **tile)
    return sml.small_m_linear_triton(x, w, **tile)


def _cycling(fn, weights):
    state = {"i": 0}

    def run():
        w = weights[state["i"] % len(weights)]
        state["i"] += 1
        return fn(w)

    return run


def bench_small_m_linear(out_path, ms=(1, 6)):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k, prologue) in LAYERS.items():
        weights = [(torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(BF16) for _ in range(COPIES)]
        norm_w = (torch.rand(k, generator=gen, device="cuda") * 0.4 + 0.8).to(BF16)
        for m in ms:
            x = torch.randn(m, 2 * k if prologue == "silu_mul" else k, generator=gen, device="cuda").to(BF16)
            residual = (torch.randn(m, k, generator=gen, device="cuda") * 4).to(BF16)
            want = _separate(prologue, x, residual, norm_w, weights[0])
            runs = [("separate", {}, lambda w: _separate(prologue, x, residual, norm_w, w))]
            runs += [("fused", t, (lambda w, t=t: _fused(prologue, x, residual, norm_w, w, t))) for t in TILES]
            runs.append(("fused-default", sml.default_tile(n, k, prologue),
                         lambda w: _fused(prologue, x, residual, norm_w, w, {})))
            for impl, tile, fn in runs:
                err = (fn(weights[0]).float() - want.float()).abs().max().item()
                us = per_launch_us(_cycling(fn, weights), launches=8 * COPIES)
                emit(out_path, {"kind": "small_m_linear", "layer": name, "prologue": prologue, "m": m, "n": n, "k": k,
                                "impl": impl, **tile, "us": us, "GBps": 2 * n * k / us / 1e3,
                                "max_abs_diff_vs_separate": err})
        del weights
        torch.cuda.empty_cache()
