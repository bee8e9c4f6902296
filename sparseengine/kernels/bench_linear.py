"""The decode step's weight GEMMs at the Llama-3.1-8B shape, cuBLAS (`F.linear`) beside
`skinny_linear_triton`'s launch configurations
(`python -m sparseengine.kernels.bench_gpu --skinny-linear --out FILE`).

Each shape is timed per launch inside a CUDA graph of launches that cycle over enough
copies of the weight (at least 512 MB) that no launch finds its weight in L2, as in a
decode step, where each layer's weights are read once. GB/s is the weight's bytes over
the time."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sparseengine.kernels._common import lazy_jit
from sparseengine.kernels.bench_common import BF16, emit, per_launch_us

if TYPE_CHECKING:
    import triton.language as tl

# name -> (N, K): the Llama-3.1-8B shape's linear layers (q|k|v and gate|up fused)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
           for bn, bk, w, s in itertools.product((16, 32, 64), (256, 512), (4, 8), (3, 5))]


def _cycling(fn, weights, x):
    state = {"i": 0}

    def call():
        w = weights[state["i"] % len(weights)]
        state["i"] += 1
        return fn(x, w)
    return call


def bench_skinny_linear(out_path, rows=(1, 6, 16), min_bytes=512 << 20, configs=None):
    """``configs``: the Triton grid to sweep (default ``CONFIGS``; [] for cuBLAS beside the
    engine's tiles alone)."""
    from sparseengine.kernels.skinny_linear import skinny_linear_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in SHAPES.items():
        copies = max(2, -(-min_bytes // (2 * N * K)))
        weights = [torch.randn(N, K, generator=gen, device="cuda", dtype=BF16) * 0.02 for _ in range(copies)]
        launches = 2 * copies
        for M in rows:
            x = torch.randn(M, K, generator=gen, device="cuda", dtype=BF16)
            want = F.linear(x.float(), weights[0].float())
            base = {"kind": "skinny_linear", "layer": name, "n": N, "k": K, "rows": M, "weight_copies": copies}
            variants = [("cublas", {}, lambda a, w: F.linear(a, w))]
            variants += [("triton", kw, lambda a, w, kw=kw: skinny_linear_triton(a, w, **kw))
                         for kw in (CONFIGS if configs is None else configs)]
            variants += [("engine", kw, lambda a, w, kw=kw: skinny_linear_triton(a, w, **kw))
                         for kw in engine_variants(N, M)]
            for impl, kw, fn in variants:
                try:
                    err = (fn(x, weights[0]).float() - want).abs().max().item()
                    us = per_launch_us(_cycling(fn, weights, x), launches=launches)
                except Exception as e:  # a configuration that does not compile is a result too
                    emit(out_path, {**base, "impl": impl, **kw, "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
                emit(out_path, {**base, "impl": impl, **kw, "us_per_launch": us,
                                "weight_gbps": 2 * N * K / us / 1e3, "max_abs_err": err})
        del weights
        torch.cuda.empty_cache()


def engine_variants(n: int, rows: int = 1) -> list[dict]:
    """The model's launch of an N-feature layer at ``rows`` rows (`engine_tiles`), its
    weight tiles through TMA or not."""
    from sparseengine.kernels.skinny_linear import engine_tiles

    return [dict(engine_tiles(n, rows=rows), tma=tma) for tma in (False, True)]


# The chain's GEMM launch configurations: the fastest of each layer in bench_skinny_linear
# at 6 rows on the H200 (block_n, block_k, num_warps, num_stages); qkv its second (the
# fastest, 5 stages, needs more shared memory than a PDL launch has).
CHAIN_CONFIGS = {"qkv": (64, 256, 4, 3), "o": (32, 256, 4, 5), "gate_up": (32, 256, 4, 3), "down": (32, 256, 4, 5)}


def bench_pdl_chain(out_path, rows=6, layers=32):
    """The decode step's GEMMs in layer order (qkv, o, gate_up, down; 32 layers of their
    own weights, 14 GB), with a one-program-a-row stand-in kernel between each pair (the
    norm, the attention, the SiLU), as one CUDA graph: cuBLAS, the skinny Triton linear,
    and the skinny linear and the stand-ins as programmatic dependent launches (each starts
    while the previous kernel runs and waits for it before reading its output); and the
    model's launches (`engine_variants`: plain and TMA weight loads, TMA with PDL). How
    much of the step the kernel boundaries cost, and how much PDL gives back."""
    from sparseengine.kernels.skinny_linear import skinny_linear_triton

    weights, x0 = chain_inputs(rows, layers)

    def chain(gemm, pdl, early=True):
        return step_chain(weights, x0, gemm, pdl, early)

    def triton_gemm(pdl):
        def gemm(a, w, name):
            bn, bk, nw, ns = CHAIN_CONFIGS[name]
            return skinny_linear_triton(a, w[name], block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, pdl=pdl)
        return gemm

    def engine_gemm(tma, pdl=False, stages=None):
        def gemm(a, w, name):
            kw = engine_variants(SHAPES[name][0])[tma]
            if stages:  # fewer stages: more programs fit an SM (o, down: 72 KB at 3), so a PDL launch can overlap
                kw = dict(kw, num_stages=stages)
            return skinny_linear_triton(a, w[name], pdl=pdl, **kw)
        return gemm

    cublas = lambda a, w, name: F.linear(a, w[name])  # noqa: E731
    engine = {f"engine{'_tma' * t}": chain(engine_gemm(t), False) for t in (0, 1)}
    engine["engine_tma_pdl"] = chain(engine_gemm(1, True), True)
    engine["engine_tma_pdl_3_stages"] = chain(engine_gemm(1, True, stages=3), True)
    variants = {"cublas": chain(cublas, False), "triton": chain(triton_gemm(False), False), **engine,
                "triton_pdl": chain(triton_gemm(True), True),
                "triton_pdl_stand_ins_trigger_last": chain(triton_gemm(True), True, early=False),
                "cublas_gate_up_triton_pdl": chain(lambda a, w, name: cublas(a, w, name) if name == "gate_up"
                                                   else triton_gemm(True)(a, w, name), True)}
    nbytes = sum(t.numel() * t.element_size() for w in weights for t in w.values())
    outs = {}
    for name, fn in variants.items():
        try:
            outs[name] = fn()
        except Exception as e:  # a launch that does not fit (e.g. PDL at 5 stages' shared memory) is a result too
            emit(out_path, {"kind": "pdl_chain", "variant": name, "rows": rows, "layers": layers,
                            "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        us = per_launch_us(fn, launches=1)
        emit(out_path, {"kind": "pdl_chain", "variant": name, "rows": rows, "layers": layers, "us_per_chain": us,
                        "weight_gbps": nbytes / us / 1e3,
                        "equals_triton": bool(torch.equal(outs[name], outs.get("triton", outs[name])))})


def chain_inputs(rows: int = 6, layers: int = 32):
    """The chain's weights (per layer {qkv, o, gate_up, down}: [N, K] bf16) and its first x [rows, hidden]."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [{name: torch.randn(*SHAPES[name], generator=gen, device="cuda", dtype=BF16) * 0.02
                for name in CHAIN_CONFIGS} for _ in range(layers)]
    return weights, torch.randn(rows, SHAPES["o"][0], generator=gen, device="cuda", dtype=BF16)


def step_chain(weights, x0, gemm, pdl: bool, early: bool = True):
    """-> a callable running the decode step's GEMMs in layer order, ``gemm(a, layer_weights,
    name)`` each, with a stand-in kernel (``_stand_in``) between each pair."""
    hidden, inter = SHAPES["o"][0], SHAPES["down"][1]

    def run():
        x = x0
        for w in weights:
            h = _stand_in(x, hidden, pdl, early)
            a = _stand_in(gemm(h, w, "qkv"), hidden, pdl, early)
            h = _stand_in(gemm(a, w, "o"), hidden, pdl, early)
            x = gemm(_stand_in(gemm(h, w, "gate_up"), inter, pdl, early), w, "down")
        return x
    return run


def _stand_in(x, width, pdl, early=True):
    """[rows, width] <- the first `width` columns of x, halved: one program a row. `pdl`: a
    programmatic dependent launch, which lets the next kernel launch at its start (`early`)
    or after its stores."""
    y = torch.empty((x.shape[0], width), dtype=x.dtype, device=x.device)
    _stand_in_kernel[(x.shape[0],)](x, y, x.stride(0), width, PDL=pdl, EARLY=early, BLOCK=1024, num_warps=4,
                                    **({"launch_pdl": True} if pdl else {}))
    return y


@lazy_jit
def _stand_in_kernel(x_ptr, y_ptr, stride_x, width, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    for c in range(0, width, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride_x + offs, mask=offs < width).to(tl.float32)
        tl.store(y_ptr + row * width + offs, (v * 0.5).to(y_ptr.dtype.element_ty), mask=offs < width)
    if PDL and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
