"""A linear layer for a few rows, its weight streamed by one program an SM in equal shares
("stream-K"): `y = x @ weight.T (+ bias)`, with `skinny_linear_triton`'s folded norm and
residual.

At a decode step's rows a layer's time is its weight's bytes over the rate the busy SMs
stream at, and one SM streams only about 1/132 of the H200's bandwidth. `skinny_linear`
gives each program whole tiles of `block_n` features over the whole reduction, so the
Llama-3.1-8B shape's qkv (96 tiles of 64) keeps 96 of 132 SMs busy, and gate_up (448
tiles) runs 3.4 waves, the last one 39% full. Here the (tile, k-block) iterations are cut
into `programs` contiguous ranges of equal length: a tile split between programs has its
parts summed by the program holding its last k-block (the tail), which adds, in program
order, the float32 partials the earlier parts' programs stored (each program stores at most
one: its range's last tile when the range ends inside it, flagged with a release store),
then applies the norm's scale, the bias, the rounding and the residual as `skinny_linear`
does. Each program first does the part it must store, then its whole tiles, and the tail it
must finish last, so a tail's earlier parts are done long before it needs them (and the
interpreter, which runs programs one after another, finds them done). A split tile's sum
runs in another order than one program's, so the result is within float32 rounding of
`skinny_linear_ref`, not bit for bit with `skinny_linear_triton`.

Shapes: N a multiple of `block_n`, K of `block_k`, at most `BLOCK_M` rows (else
`skinny_linear_triton`). The flags are the caller's (`flags`, int32 zeros, at least
`programs`; each launch leaves them at zero), else one buffer per device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _common
from ._common import check_launch, dot_precision, int_arg, interpreting, lazy_jit
from .skinny_linear import BLOCK_M, _tile_dot

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl

MAX_PROGRAMS = 1024
# Whether the model's linear layers run this kernel where they would run skinny_linear's
# (and the shapes fit), with these tiles; read at each call (profile_decode_step.py
# --kernel-const sets them for A/Bs). `programs_per_sm`: the grid, in programs an SM.
ENGINE_STREAM_K = False
ENGINE_TILES = dict(block_n=64, block_k=256, num_stages=5, programs_per_sm=1)


def engine_launch(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The model's launch knobs for this layer when it runs here (a GPU, `ENGINE_STREAM_K`,
    shapes that fit), else None."""
    tiles = dict(ENGINE_TILES)
    per_sm = tiles.pop("programs_per_sm", 1)
    if not (ENGINE_STREAM_K and x.is_cuda and fits(x, weight, tiles["block_n"], tiles["block_k"])):
        return None
    return dict(tiles, programs=per_sm * _common.num_sms(x.device))


def fits(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int) -> bool:
    """Whether `streamk_linear_triton` takes these shapes."""
    N, K = weight.shape
    rows = x.numel() // max(x.shape[-1], 1)
    return 0 < rows <= BLOCK_M and x.shape[-1] == K and N % block_n == 0 and K % block_k == 0


def streamk_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                          rms_eps: float | None = None, residual: torch.Tensor | None = None,
                          block_n: int = 64, block_k: int = 256, tma: bool = False, programs: int | None = None,
                          flags: torch.Tensor | None = None, num_warps: int = 4, num_stages: int = 5) -> torch.Tensor:
    """`skinny_linear_triton`'s contract (x `[..., K]`, weight `[N, K]`, bias, `rms_eps`,
    `residual`, `tma`) over `programs` equal shares of the (tile, k-block) iterations
    (default one an SM on a GPU, 3 in the interpreter)."""
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
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if int_arg(name, v, 16) & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if not fits(x, weight, block_n, block_k):
        raise ValueError(f"streamk_linear needs 1..{BLOCK_M} rows, N={N} a multiple of block_n={block_n} and "
                         f"K={K} of block_k={block_k}; got {x.numel() // max(K, 1)} rows")
    if rms_eps is not None and not (isinstance(rms_eps, (int, float)) and rms_eps >= 0):
        raise ValueError(f"rms_eps must be a number >= 0 or None, got {rms_eps!r}")
    if residual is not None and (tuple(residual.shape) != (*x.shape[:-1], N) or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {(*x.shape[:-1], N)} in {x.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    device = check_launch(x, weight, *(t for t in (bias, residual) if t is not None))
    programs = int_arg("programs", programs if programs is not None else
                       (3 if interpreting() else _common.num_sms(device)), 1)
    iters = (N // block_n) * (K // block_k)
    programs = min(programs, iters, MAX_PROGRAMS)
    if flags is None:
        flags = _common.zeroed_counters("streamk_linear", MAX_PROGRAMS, device)
    elif (not isinstance(flags, torch.Tensor) or flags.dtype != torch.int32 or flags.dim() != 1
          or flags.numel() < programs or flags.stride(0) != 1 or flags.device != device):
        got = (f"{tuple(flags.shape)} {flags.dtype} on {flags.device}" if isinstance(flags, torch.Tensor)
               else type(flags).__name__)
        raise ValueError(f"flags must be a contiguous int32 vector of at least programs = {programs} on {device}, "
                         f"got {got}")
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
    parts = _common.empty((programs, block_n, BLOCK_M), torch.float32, device)
    r2 = y if residual is None else residual.reshape(M, N)  # y: a dummy, never read
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    _streamk_kernel[(programs,)](
        x2, weight, w_desc, weight if bias is None else bias, r2, y, parts, flags, M, N, K, x2.stride(0),
        weight.stride(0), r2.stride(0), y.stride(0), float(rms_eps or 0.0),
        HAS_BIAS=bias is not None, NORM=rms_eps is not None, RESIDUAL=residual is not None, TMA=tma,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, INTERPRET=interpreting(),
        DOT_PREC=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages)
    return y.reshape(*lead, N)


def _segment(x_rows, w_ptr, w_desc, n0, kb_lo, kb_hi, stride_wn, m_ok, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_K: tl.constexpr, TMA: tl.constexpr, INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr):
    """The float32 sum over k-blocks [kb_lo, kb_hi) of features [n0, n0 + BLOCK_N): [BLOCK_N, BLOCK_M]."""
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k0 = kb * BLOCK_K
        xk = tl.load(x_rows + (k0 + kk)[None, :], mask=m_ok[:, None], other=0.0)
        if TMA:
            w = w_desc.load([n0, k0])
        else:
            w = tl.load(w_rows + (k0 + kk)[None, :])
        acc = _tile_dot(w, xk, acc, INTERPRET, DOT_PREC)
    return acc


def _finish(acc, inv, b_ptr, r_ptr, y_ptr, n0, m, m_ok, stride_rm, stride_ym, BLOCK_N: tl.constexpr,
            HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """A tile's whole sum to the output: skinny_linear's epilogue."""
    n = n0 + tl.arange(0, BLOCK_N)
    if NORM:
        acc *= inv[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n).to(tl.float32)[:, None]
    yv = acc.to(y_ptr.dtype.element_ty)
    if RESIDUAL:
        res = tl.load(r_ptr + m.to(tl.int64)[None, :] * stride_rm + n[:, None], mask=m_ok[None, :], other=0.0)
        yv = (yv.to(tl.float32) + res.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None], yv, mask=m_ok[None, :])


@lazy_jit
def _streamk_kernel(x_ptr, w_ptr, w_desc, b_ptr, r_ptr, y_ptr, part_ptr, flag_ptr, M, N, K, stride_xm, stride_wn,
                    stride_rm, stride_ym, eps, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    KB = K // BLOCK_K
    total = (N // BLOCK_N) * KB
    s = (pid.to(tl.int64) * total // G).to(tl.int32)  # this program's iterations [s, e)
    e = ((pid + 1).to(tl.int64) * total // G).to(tl.int32)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:  # the rows' whole sums of squares (a tile's parts each see only their k-blocks)
        kk = tl.arange(0, BLOCK_K)
        ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xk = tl.load(x_rows + (k0 + kk)[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
            ss += xk * xk
        inv = 1.0 / tl.sqrt_rn(tl.sum(ss, axis=1) / K + eps)
    part_rows = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    t_first = s // KB
    t_last = (e - 1) // KB
    # 1. The range's last tile, when the range ends inside it: a partial for a later program.
    if e < (t_last + 1) * KB:
        lo = tl.maximum(s, t_last * KB)
        acc = _segment(x_rows, w_ptr, w_desc, t_last * BLOCK_N, lo - t_last * KB, e - t_last * KB, stride_wn, m_ok,
                       BLOCK_N, BLOCK_M, BLOCK_K, TMA, INTERPRET, DOT_PREC)
        tl.store(part_ptr + pid.to(tl.int64) * (BLOCK_N * BLOCK_M) + part_rows, acc)
        tl.debug_barrier()  # every thread's stores before the flag
        tl.atomic_xchg(flag_ptr + pid, 1, sem="release", scope="gpu")
        t_end = t_last  # tiles [t_first, t_end) remain
    else:
        t_end = t_last + 1
    # 2. Whole tiles after the first: this program's alone.
    for t in range(t_first + 1, t_end):
        acc = _segment(x_rows, w_ptr, w_desc, t * BLOCK_N, 0, KB, stride_wn, m_ok, BLOCK_N, BLOCK_M, BLOCK_K, TMA,
                       INTERPRET, DOT_PREC)
        _finish(acc, inv, b_ptr, r_ptr, y_ptr, t * BLOCK_N, m, m_ok, stride_rm, stride_ym, BLOCK_N, HAS_BIAS, NORM,
                RESIDUAL)
    # 3. The first tile, when this program holds its last k-block: its own part, plus the
    # earlier programs' partials (program q holds the part before q + 1's), then the output.
    if t_first < t_end:
        acc = _segment(x_rows, w_ptr, w_desc, t_first * BLOCK_N, s - t_first * KB, KB, stride_wn, m_ok, BLOCK_N,
                       BLOCK_M, BLOCK_K, TMA, INTERPRET, DOT_PREC)
        q = pid - 1
        more = s > t_first * KB
        while more:
            while tl.atomic_add(flag_ptr + q, 0, sem="acquire", scope="gpu") == 0:
                pass
            acc += tl.load(part_ptr + q.to(tl.int64) * (BLOCK_N * BLOCK_M) + part_rows)
            tl.atomic_xchg(flag_ptr + q, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            more = (q.to(tl.int64) * total // G) > t_first * KB  # q's range started inside the tile too
            q -= 1
        _finish(acc, inv, b_ptr, r_ptr, y_ptr, t_first * BLOCK_N, m, m_ok, stride_rm, stride_ym, BLOCK_N, HAS_BIAS,
                NORM, RESIDUAL)
