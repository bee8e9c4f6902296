"""The decode step's linears in CUDA (`cuda_linear`) beside the Triton kernel the engine
ran before (`skinny_linear` with `engine_tiles`), with the folds each layer takes in the
model (`python -m sparseengine.kernels.bench_gpu --cuda-linear --out FILE`):

- per launch at the Llama-3.1-8B shape, 1, 6 and 8 rows (a batch of 6 replays the graph of 8), in CUDA graphs of
  launches cycling over weight copies (no weight in L2), as `bench_linear.bench_skinny_linear`: qkv with the
  norm, o and down with the residual, gate_up with the norm (Triton: then the SiLU kernel;
  CUDA: gated), CUDA with x staged and not;
- the step's linears in model order for 32 layers of their own weights (qkv, a stand-in for
  the attention, o, gate_up, [SiLU], down), one CUDA graph: Triton, CUDA, CUDA without PDL,
  and CUDA in the builds whose grid holds several CTAs an SM (`GRID_BUILDS`).
"""
from __future__ import annotations

import contextlib

import torch

from sparseengine.kernels import cuda_linear as C
from sparseengine.kernels.bench_common import BF16, emit, per_launch_us
from sparseengine.kernels.bench_linear import SHAPES, _stand_in, chain_inputs
from sparseengine.kernels.fused_ops import silu_mul_triton
from sparseengine.kernels.skinny_linear import engine_tiles, skinny_linear_triton

EPS = 1e-5
FOLDS = {"qkv": "norm", "o": "residual", "gate_up": "norm", "down": "residual"}
# cuda_linear builds (warps, steps, min CTAs, grid CTAs) the model-order chain also runs
GRID_BUILDS = {"cuda_pdl_8warps_x2": (8, 4, 2, 2), "cuda_pdl_4warps_x4": (4, 4, 4, 4)}


@contextlib.contextmanager
def using_build(build):
    """cuda_linear's launches in this block take `build` (its BUILD_* constants, restored after)."""
    names = ("BUILD_WARPS", "BUILD_STEPS", "BUILD_MIN_CTAS", "BUILD_GRID_CTAS")
    before = [getattr(C, n) for n in names]
    try:
        for n, v in zip(names, build):
            setattr(C, n, v)
        yield
    finally:
        for n, v in zip(names, before):
            setattr(C, n, v)


def _triton(name, rows):
    tiles = engine_tiles(SHAPES[name][0], BF16, torch.device("cuda"), rows)

    def run(x, w, res=None):
        y = skinny_linear_triton(x, w, rms_eps=EPS if FOLDS[name] == "norm" else None, residual=res, **tiles)
        return silu_mul_triton(y) if name == "gate_up" else y
    return run


def _cuda(name, pdl=True, staged=None):
    def run(x, w, res=None):  # gate_up: w interleaved
        return C.cuda_linear(x, w, rms_eps=EPS if FOLDS[name] == "norm" else None, residual=res,
                             gated=name == "gate_up", pdl=pdl, staged=staged)
    return run


def bench_cuda_linear(out_path, rows=(1, 6, 8), min_bytes=512 << 20):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in FOLDS:
        n, k = SHAPES[name]
        copies = max(2, -(-min_bytes // (2 * n * k)))
        plain = [torch.randn(n, k, generator=gen, device="cuda", dtype=BF16) * 0.02 for _ in range(copies)]
        mine = [C.interleave_gate_up(w) for w in plain] if name == "gate_up" else plain
        for m in rows:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=BF16)
            res = torch.randn(m, n, generator=gen, device="cuda", dtype=BF16) if FOLDS[name] == "residual" else None
            want = _triton(name, m)(x, plain[0], res).float()
            variants = {"triton_engine": (_triton(name, m), plain)}
            for staged in (False, True):
                variants[f"cuda_staged{int(staged)}"] = (_cuda(name, staged=staged), mine)
            variants["cuda_auto_no_pdl"] = (_cuda(name, pdl=False), mine)
            for impl, (fn, weights) in variants.items():
                state = {"i": 0}

                def call(fn=fn, weights=weights):
                    state["i"] += 1
                    return fn(x, weights[state["i"] % len(weights)], res)
                got = fn(x, weights[0], res).float()
                rel = ((got - want).abs().max() / want.abs().max()).item()
                us = per_launch_us(call, launches=2 * copies)
                emit(out_path, {"kind": "cuda_linear", "layer": name, "n": n, "k": k, "rows": m, "impl": impl,
                                "fold": FOLDS[name] + ("+silu" if name == "gate_up" else ""), "us_per_launch": us,
                                "weight_gbps": 2 * n * k / us / 1e3, "rel_err_vs_triton": rel})
        del plain, mine
        torch.cuda.empty_cache()
    bench_model_order_chain(out_path)


def bench_model_order_chain(out_path, rows=6, layers=32):
    weights, x0 = chain_inputs(rows, layers)
    inter = [C.interleave_gate_up(w["gate_up"]) for w in weights]
    hidden = SHAPES["o"][0]

    def chain(kind, pdl=True, build=None):
        def run():
            with using_build(build) if build else contextlib.nullcontext():
                return layers_in_order()

        def layers_in_order():
            h = x0
            for i, w in enumerate(weights):
                if kind == "triton":
                    lin = {name: (lambda a, ww, r=None, name=name: _triton(name, rows)(a, ww, r)) for name in FOLDS}
                    up = w["gate_up"]
                else:
                    lin = {name: _cuda(name, pdl=pdl) for name in FOLDS}
                    up = inter[i]
                qkv = lin["qkv"](h, w["qkv"])
                a = _stand_in(qkv, hidden, False)  # the attention
                h = lin["o"](a, w["o"], h)
                h = lin["down"](lin["gate_up"](h, up), w["down"], h)
            return h
        return run

    variants = {"triton_engine": chain("triton"), "cuda_pdl": chain("cuda"), "cuda_no_pdl": chain("cuda", False),
                **{name: chain("cuda", build=b) for name, b in GRID_BUILDS.items()},
                "triton_engine_again": chain("triton")}
    nbytes = sum(t.numel() * t.element_size() for w in weights for t in w.values())
    ref = None
    for name, fn in variants.items():
        y = fn().float()
        ref = y if ref is None else ref
        us = per_launch_us(fn, launches=1)
        emit(out_path, {"kind": "cuda_linear_chain", "variant": name, "rows": rows, "layers": layers,
                        "us_per_chain": us, "weight_gbps": nbytes / us / 1e3,
                        "rel_err_vs_triton": ((y - ref).abs().max() / ref.abs().max()).item()})
