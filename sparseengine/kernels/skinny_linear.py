"""A linear layer for a few rows: `y = x @ weight.T (+ bias)` when x has few rows (a decode
step's tokens), streaming the weight once.

At a decode step's batch the weight GEMMs are bound by reading the weight: a handful of
rows multiply every weight element once. `skinny_linear_triton` gives each program
`block_n` output features (weight rows) over the whole reduction, so the weight is read
once, in order, as wide loads, by `cdiv(N, block_n)` programs (`cdiv(M, 16)` row blocks
each, in one launch; one for a decode batch of up to 16 tokens). The rows of x sit in L2
and are read by every program. float32 accumulation (`tl.dot`), one rounding to the output
dtype at the end, as cuBLAS does; the summation order differs from cuBLAS's, so the result
agrees with `skinny_linear_ref` (`F.linear`) to float32 rounding, not bit for bit.

`skinny_linear_ref` is `torch.nn.functional.linear`, the oracle.

The model's linear layers (`layers/linear.py`) use it for up to `ENGINE_MAX_ROWS` rows on
a GPU where the CUDA kernel (`cuda_linear`: 1-8 bf16 rows on an sm_90 GPU with nvcc) does
not run, cuBLAS above. There it also applies the RMSNorm before qkv and gate_up (`rms_eps`:
the model folds each norm's weight into those layers' weights at load, `FOLD_NORMS`) and
the residual add after o and down (`residual`): two launches fewer a layer, 1.0-1.2% off
the decode step of Quest b=6, OmniKV b=6 and vanilla b=1 at 128K on the H200
(`fold_norms_ab_h200.jsonl`). With each layer's tiles (`engine_tiles`) it took 0.7-15% less time
than cuBLAS at the Llama-3.1-8B shape's layers at 1 and 6 rows on the H200 (at 16 rows the
same but gate_up, 4% more), with no separate split-K reduce (`skinny_linear_h200.jsonl`).
In the engine's decode step (session 17, one call, `profile_decode_step.py --kernel-const
skinny_linear.ENGINE_MAX_ROWS=0/16`, twice each) the linears of Quest at batch 6 took
3.89 ms a step against cuBLAS's 4.02. A variant that computed the MLP's SiLU-and-multiply
in the down projection's loads (every program recomputing it for its rows) took them to
22.6 ms: not kept. As programmatic dependent launches in a chain of the step's GEMMs it
made the chain slower (results/README.md, `pdl_chain_h200.jsonl`; `bench_gpu
--skinny-linear`, `--pdl-chain`); a persistent CUDA probe launched that way gave back
136-319 us of the same chain, its tensor-core version 2.2% under this kernel's chain
while slower launch by launch (`scripts/cuda_gemv.cu`, `cuda_gemv_h200.jsonl`). Spreading the features evenly over
whole waves of the SMs (qkv on 132 programs, not 96) made the step slower (session 21,
`ab_switches_h200.jsonl`): removed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import _common
from ._common import cdiv, check_launch, dot_precision, int_arg, interpreting, lazy_jit
from .fused_ops import rms_norm_ref

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl

BLOCK_M = 16  # rows of x a program multiplies: tl.dot's smallest tile (32 for 17-32 rows: one row block)
# The model's linear layers (layers/linear.py) use this kernel for at most this many rows on
# a GPU (0: never, cuBLAS always; profile_decode_step.py --kernel-const sets it for A/Bs).
ENGINE_MAX_ROWS = 32
# Whether the model's linear layers load the weight's tiles through a tensor descriptor
# (`tma`; read at each call).
TMA_LOADS = True  # A/B session 21 (results/ab_switches_h200.jsonl): Quest b=6 step -0.013 ms, vanilla b=1 -0.02
# Whether a model on a GPU folds each RMSNorm into the linear after it and each residual
# add into the linear before it (`rms_eps`, `residual`; LlamaForCausalLM.fold_norms), read
# when an engine loads its model (profile_decode_step.py --kernel-const sets it for A/Bs).
FOLD_NORMS = True


def streams(x: torch.Tensor) -> bool:
    """Whether the model's linear layers run this kernel on `x` (a GPU, at most ENGINE_MAX_ROWS rows)."""
    return x.is_cuda and 0 < x.numel() // max(x.shape[-1], 1) <= ENGINE_MAX_ROWS


def engine_tiles(n: int, dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None,
                 rows: int = 1) -> dict:
    """Launch knobs for an N-feature layer: the fastest of bench_gpu --skinny-linear's grid
    at 6 rows on the H200 (results/skinny_linear_h200.jsonl, d44d4d6, bf16): 64 features a
    program for the wide layers (qkv, gate_up, lm_head), 32 for the 4096-wide ones (o,
    down); 256 channels a step, 4 warps, 5 stages. A 4-byte dtype takes 128 channels a
    step: the same bytes a stage, inside the shared memory (bf16's tiles in float32 would
    need 320 KB at 64 features). Above 16 ``rows``, row blocks of 32 (one for up to 32
    rows: the weight is still read once), 4 stages (5 would overflow the shared memory at
    64 features), and plain loads in the 4096-wide layers: at 17-24 rows on the H200
    (results/skinny_rows_31217d7_h200.jsonl) TMA loads took o 13.0-13.1 us against 12.3
    plain and down 37.1-37.5 against 34.9 (cuBLAS: 12.6, 32.1, without the residual add
    this kernel folds in), while qkv, gate_up and lm_head ran faster than cuBLAS with TMA.
    On a CUDA `device`: `tma` with TMA_LOADS."""
    block_k = 512 // dtype.itemsize
    wide = n >= 6144
    tiles = dict(block_n=64 if wide else 32, block_k=block_k, num_warps=4, num_stages=5)
    if rows > BLOCK_M:
        tiles.update(block_m=2 * BLOCK_M, num_stages=4)
    if TMA_LOADS and device is not None and device.type == "cuda" and (wide or rows <= BLOCK_M):
        tiles["tma"] = True
    return tiles


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      rms_eps: float | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; with `rms_eps`, of RMSNorm(x) with a unit weight (the
    model's norm, `fused_ops.rms_norm_ref`); with `residual`, plus it (after rounding to
    x's dtype)."""
    if rms_eps is not None:
        x = rms_norm_ref(x, torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), rms_eps)
    y = F.linear(x, weight, bias)
    return y if residual is None else y + residual


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                         rms_eps: float | None = None, residual: torch.Tensor | None = None,
                         block_n: int = 16, block_k: int = 512, tma: bool = False,
                         num_warps: int = 4, num_stages: int = 4, pdl: bool = False,
                         block_m: int = BLOCK_M) -> torch.Tensor:
    """`x [..., K]`, `weight [N, K]` (rows contiguous), `bias [N]` or None -> `[..., N]` in
    x's dtype. `block_n`, `block_k`, `block_m` (rows of x a program takes; the weight is
    read once per block of rows): powers of two, at least 16; `num_warps`, `num_stages`:
    Triton's launch knobs. `pdl`: launch as a programmatic dependent launch (Hopper): the
    programs start while the previous kernel runs, load their first weight tile, and wait
    for it (`griddepcontrol.wait`) before reading x; once past their reduction loop they
    let the next kernel launch.

    `tma`: load the weight's tiles through a tensor descriptor (Hopper's tensor memory
    accelerator copies them; the weight's rows must start 16-byte aligned).

    `rms_eps`: the linear of RMSNorm(x) with a unit weight (a model folds its norm's weight
    into this layer's weight): the loop also sums x's squares in float32, and the epilogue
    scales each row by rsqrt(mean + rms_eps). Within float32 rounding of the exact result,
    as the plain linear is; the model's norm then linear also rounds the scaled x to its
    dtype. `residual [..., N]` (x's dtype): the result rounded to x's dtype, plus residual
    (one more rounding), as the model's residual add after the linear."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a [N, K] tensor, got {getattr(weight, 'shape', type(weight).__name__)}")
    N, K = weight.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must end in K={K} features (weight {tuple(weight.shape)}), got {tuple(x.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must be [N={N}], got {tuple(bias.shape)}")
    for name, v in (("block_n", block_n), ("block_k", block_k), ("block_m", block_m)):
        if int_arg(name, v, 16) & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if rms_eps is not None and not (isinstance(rms_eps, (int, float)) and rms_eps >= 0):
        raise ValueError(f"rms_eps must be a number >= 0 or None, got {rms_eps!r}")
    if residual is not None and (tuple(residual.shape) != (*x.shape[:-1], N) or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {(*x.shape[:-1], N)} in {x.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    extra = tuple(t for t in (bias, residual) if t is not None)
    device = check_launch(x, weight, *extra)
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    w_desc = weight  # a placeholder the kernel does not read unless TMA
    if tma:
        if weight.data_ptr() % 16 or (weight.stride(0) * weight.element_size()) % 16:
            raise ValueError(f"tma needs 16-byte aligned weight rows, got a base at {weight.data_ptr()} "
                             f"and rows of {weight.stride(0) * weight.element_size()} bytes")
        from triton.tools.tensor_descriptor import TensorDescriptor

        w_desc = TensorDescriptor(weight, shape=[N, K], strides=[weight.stride(0), 1], block_shape=[block_n, block_k])
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = _common.empty((M, N), x.dtype, device)
    r2 = y if residual is None else residual.reshape(M, N)  # y: a dummy, never read
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    if M and N:
        _skinny_linear_kernel[(cdiv(N, block_n), cdiv(M, block_m))](
            x2, weight, w_desc, weight if bias is None else bias, r2, y, M, N, K, x2.stride(0), weight.stride(0),
            r2.stride(0), y.stride(0), float(rms_eps or 0.0),
            HAS_BIAS=bias is not None, NORM=rms_eps is not None, RESIDUAL=residual is not None, TMA=tma,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_N=N % block_n == 0, EVEN_K=K % block_k == 0, INTERPRET=interpreting(),
            DOT_PREC=dot_precision(x.dtype), PDL=pdl, num_warps=num_warps, num_stages=num_stages,
            **({"launch_pdl": True} if pdl else {}))
    return y.reshape(*lead, N)


def _tile_dot(w, x, acc, INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + w @ x.T in float32."""
    if INTERPRET:  # the interpreter's bf16 tl.dot is wrong; float32 products of bf16 are exact
        w, x = w.to(tl.float32), x.to(tl.float32)
    return tl.dot(w, tl.trans(x), acc, input_precision=DOT_PREC)


@lazy_jit
def _skinny_linear_kernel(x_ptr, w_ptr, w_desc, b_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_rm,
                          stride_ym, eps, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                          TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                          INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    # acc[n, m] = sum_k w[n, k] * x[m, k]: the weight tile is the dot's left operand, so
    # BLOCK_N (not the few rows of x) is the MMA's row dimension.
    n0 = tl.program_id(0) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)  # x's squares, summed across once after the loop
    k_start = 0
    if PDL:  # the weight does not depend on the previous kernel: its first tile before the wait
        if TMA:
            w = w_desc.load([n0, 0])
        else:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < K), other=0.0)
        if not INTERPRET:  # the interpreter runs one program at a time, and knows no griddepcontrol
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_rows + kk[None, :], mask=(m[:, None] < M) & (kk[None, :] < K), other=0.0)
        if NORM:
            ss += x.to(tl.float32) * x.to(tl.float32)
        acc = _tile_dot(w, x, acc, INTERPRET, DOT_PREC)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        k = k0 + kk
        x = tl.load(x_rows + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        if NORM:
            ss += x.to(tl.float32) * x.to(tl.float32)
        if TMA:  # the tensor memory accelerator copies the tile (rows and channels past the weight: zeros)
            w = w_desc.load([n0, k0])
        elif EVEN_N and EVEN_K:
            w = tl.load(w_rows + k[None, :])
        elif EVEN_K:  # a mask constant along k: the loads stay vectorised
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
        acc = _tile_dot(w, x, acc, INTERPRET, DOT_PREC)
    if PDL and not INTERPRET:  # the next kernel may start on the SMs this one leaves
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:
        acc *= (1.0 / tl.sqrt_rn(tl.sum(ss, axis=1) / K + eps))[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    mask = n_ok[:, None] & (m[None, :] < M)
    y = acc.to(y_ptr.dtype.element_ty)
    if RESIDUAL:
        res = tl.load(r_ptr + m.to(tl.int64)[None, :] * stride_rm + n[:, None], mask=mask, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None], y, mask=mask)
