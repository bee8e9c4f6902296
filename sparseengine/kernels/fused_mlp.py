"""The decode step's MLP in one launch: `y = down(silu(gate) * up) (+ residual)` for a few
rows, `gate, up = gate_up(RMSNorm(x))`, streaming both weights once.

In the unfused step the MLP is three launches: gate_up (`skinny_linear`, 448 programs of
64 weight rows at the Llama-3.1-8B shape: 3.4 waves of the H200's 132 SMs, the last one
39% full), SiLU-and-multiply, and down, whose programs start only after gate_up's last
wave drains. Here one grid of persistent programs (one an SM) first computes
`h = silu(gate) * up` tile by tile (`block_n` features a tile: their gate rows and their
up rows, the norm's scale and the SiLU in the tile's epilogue), then the down projection,
`block_n2` output features a tile over the whole of h. h is cut into `chunks` parts along
its features; each finished gate_up tile counts itself in on its part's counter (release,
after a barrier so that its stores come first), and a down tile waits (acquire) for a
part only when its reduction reaches it. Tiles go to programs round-robin, gate_up tiles
first; a program with fewer gate_up tiles takes its down tiles first. So the programs
done with gate_up stream down's weight for the parts already written while the last
gate_up tiles finish, and no launch boundary sits between the three. The last program
to finish zeroes the counters for the next launch (the caller's, `counters`, at a fixed
address for CUDA-graph replays).

The roundings are the unfused path's: gate and up rounded to x's dtype, the SiLU rounded,
times up rounded (`fused_ops.silu_mul`), down's output rounded, plus the residual rounded
(`skinny_linear`'s `residual`). The sums run in float32 on tensor cores (`tl.dot`) in K
order, as `skinny_linear`'s do, so the result is within float32 rounding of
`fused_mlp_ref` (the unfused torch composition), not bit for bit.

The interpreter runs a grid's programs one after another, so a program waiting on
another's tiles would wait forever: there the grid is one program (`programs=1`), which
takes every tile in order.

Shapes: the hidden size a multiple of `block_k` and `block_n2`; the intermediate size a
multiple of `chunks * block_k` and of `block_n`; at most `BLOCK_M` rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _common
from ._common import check_launch, dot_precision, int_arg, interpreting, lazy_jit
from .fused_ops import silu_mul_ref
from .skinny_linear import BLOCK_M, skinny_linear_ref
from .tile_math import _round_to, _silu_mul_value, _tile_dot

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl

# Whether the model's MLP runs this kernel where it can (`LlamaForCausalLM`'s decode rows on
# a GPU, shapes as above), read at each call (profile_decode_step.py --kernel-const sets it).
ENGINE_FUSED_MLP = False
# The model's launch (read at each call; profile_decode_step.py --kernel-const sets it for A/Bs).
ENGINE_TILES = dict(block_n=32, block_n2=32, block_k=256, chunks=2)
MAX_CHUNKS = 8


def fused_mlp_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *, rms_eps: float | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused path in torch: `skinny_linear_ref` (gate_up, the norm folded), `silu_mul_ref`,
    `skinny_linear_ref` (down, the residual added)."""
    h = silu_mul_ref(skinny_linear_ref(x, w_gate_up, rms_eps=rms_eps))
    return skinny_linear_ref(h, w_down, residual=residual)


def fits(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *, block_n: int = 32,
         block_n2: int = 32, block_k: int = 256, chunks: int = 2) -> bool:
    """Whether `fused_mlp_triton` takes these shapes (else the unfused path)."""
    H, I = w_down.shape
    rows = x.numel() // max(x.shape[-1], 1)
    return (0 < rows <= BLOCK_M and tuple(w_gate_up.shape) == (2 * I, H) and x.shape[-1] == H
            and H % block_k == 0 and H % block_n2 == 0 and I % (chunks * block_k) == 0 and I % block_n == 0
            and (I // chunks) % block_n == 0)


def fused_mlp_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *,
                     rms_eps: float | None = None, residual: torch.Tensor | None = None,
                     counters: torch.Tensor | None = None, block_n: int = 32, block_n2: int = 32,
                     block_k: int = 256, chunks: int = 2, programs: int | None = None, tma: bool = False,
                     num_warps: int = 4, num_stages: int = 5, return_hidden: bool = False, spin: int = 0):
    """`x [..., H]`, `w_gate_up [2I, H]` (gate rows, then up rows), `w_down [H, I]` -> `[..., H]`
    in x's dtype. `rms_eps`: gate_up of RMSNorm(x) with a unit weight (the model folds the
    norm's weight into gate_up's); `residual [..., H]`: added to the result.
    `counters`: int32 zeros, at least `chunks + 1` (each launch leaves them at zero; default
    one shared buffer per device, which launches running at once on two streams of one
    device must not share). `block_n`: features a gate_up tile (its gate and its up rows),
    `block_n2`: output features a down tile, `block_k`: channels a step, `chunks`: parts of
    h a down tile waits for one by one. `programs`: the grid (default one an SM on a GPU,
    1 in the interpreter, which must keep 1). `tma`: load the weights' tiles through tensor
    descriptors (16-byte aligned rows). `return_hidden`: also return h `[..., I]`, the
    down projection's input (for tests)."""
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor, got {getattr(w, 'shape', type(w).__name__)}")
    H, I = w_down.shape
    if tuple(w_gate_up.shape) != (2 * I, H):
        raise ValueError(f"w_gate_up must be [2I, H] = [{2 * I}, {H}] for w_down {tuple(w_down.shape)}, got "
                         f"{tuple(w_gate_up.shape)}")
    if x.dim() < 1 or x.shape[-1] != H:
        raise ValueError(f"x must end in H={H} features, got {tuple(x.shape)}")
    if not (x.dtype == w_gate_up.dtype == w_down.dtype):
        raise ValueError(f"x and the weights must share a dtype, got {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")
    for name, v in (("block_n", block_n), ("block_n2", block_n2), ("block_k", block_k)):
        if int_arg(name, v, 16) & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if not 1 <= int_arg("chunks", chunks, 1) <= MAX_CHUNKS:
        raise ValueError(f"chunks must be in [1, {MAX_CHUNKS}], got {chunks}")
    if not fits(x, w_gate_up, w_down, block_n=block_n, block_n2=block_n2, block_k=block_k, chunks=chunks):
        raise ValueError(f"fused_mlp needs 1..{BLOCK_M} rows, H={H} a multiple of block_k={block_k} and "
                         f"block_n2={block_n2}, I={I} a multiple of chunks * block_k = {chunks * block_k} and of "
                         f"block_n={block_n} a chunk; got {x.numel() // max(H, 1)} rows")
    if rms_eps is not None and not (isinstance(rms_eps, (int, float)) and rms_eps >= 0):
        raise ValueError(f"rms_eps must be a number >= 0 or None, got {rms_eps!r}")
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {tuple(x.shape)} in {x.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    device = check_launch(x, w_gate_up, w_down, *(() if residual is None else (residual,)))
    if counters is None:
        counters = _common.zeroed_counters("fused_mlp", MAX_CHUNKS + 1, device)
    elif (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32 or counters.dim() != 1
          or counters.numel() < chunks + 1 or counters.stride(0) != 1 or counters.device != device):
        got = (f"{tuple(counters.shape)} {counters.dtype} on {counters.device}" if isinstance(counters, torch.Tensor)
               else type(counters).__name__)
        raise ValueError(f"counters must be a contiguous int32 vector of at least chunks + 1 = {chunks + 1} on "
                         f"{device}, got {got}")
    if interpreting():
        if programs not in (None, 1):
            raise ValueError(f"the interpreter runs programs one after another: programs must be 1, got {programs}")
        programs = 1
    elif programs is None:
        programs = _common.num_sms(device)
    programs = int_arg("programs", programs, 1)
    w_gate_up, w_down = (w if w.stride(1) == 1 else w.contiguous() for w in (w_gate_up, w_down))
    gu_desc, d_desc = w_gate_up, w_down  # placeholders the kernel does not read unless TMA
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
            if w.data_ptr() % 16 or (w.stride(0) * w.element_size()) % 16:
                raise ValueError(f"tma needs 16-byte aligned {name} rows")
        gu_desc = TensorDescriptor(w_gate_up, shape=[2 * I, H], strides=[w_gate_up.stride(0), 1],
                                   block_shape=[block_n, block_k])
        d_desc = TensorDescriptor(w_down, shape=[H, I], strides=[w_down.stride(0), 1], block_shape=[block_n2, block_k])
    lead = x.shape[:-1]
    x2 = x.reshape(-1, H)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    h = _common.empty((M, I), x.dtype, device)
    y = _common.empty((M, H), x.dtype, device)
    r2 = y if residual is None else residual.reshape(M, H)  # y: a dummy, never read
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    _fused_mlp_kernel[(programs,)](
        x2, w_gate_up, gu_desc, w_down, d_desc, h, r2, y, counters, M, H, I, x2.stride(0), w_gate_up.stride(0),
        w_down.stride(0), h.stride(0), r2.stride(0), y.stride(0), float(rms_eps or 0.0),
        NORM=rms_eps is not None, RESIDUAL=residual is not None, TMA=tma, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_N2=block_n2, BLOCK_K=block_k, CHUNKS=chunks, INTERPRET=interpreting(),
        DOT_PREC=dot_precision(x.dtype), SPIN=spin, num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=False, enable_reflect_ftz=False,  # the SiLU as fused_ops.silu_mul computes it
    )
    y = y.reshape(*lead, H)
    return (y, h.reshape(*lead, I)) if return_hidden else y


@lazy_jit
def _fused_mlp_kernel(x_ptr, wgu_ptr, wgu_desc, wd_ptr, wd_desc, h_ptr, r_ptr, y_ptr, cnt_ptr, M, H, I,
                      stride_xm, stride_wgu, stride_wd, stride_hm, stride_rm, stride_ym, eps,
                      NORM: tl.constexpr, RESIDUAL: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
                      INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, SPIN: tl.constexpr = 0):
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    kk = tl.arange(0, BLOCK_K)
    nn = tl.arange(0, BLOCK_N)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    h_rows = h_ptr + m.to(tl.int64)[:, None] * stride_hm
    T1 = I // BLOCK_N  # gate_up tiles
    per_chunk = T1 // CHUNKS  # tiles a part of h
    # Gate_up tiles t = pid, pid + G, ...: h's features [t * BLOCK_N, (t + 1) * BLOCK_N).
    for t in range(pid, T1, G):
        f0 = t * BLOCK_N
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            xk = tl.load(x_rows + (k0 + kk)[None, :], mask=m_ok[:, None], other=0.0)
            if NORM:  # as skinny_linear's, whose launch contracts this into an FMA
                xf = xk.to(tl.float32)
                if INTERPRET:
                    ss += xf * xf
                else:
                    ss = tl.fma(xf, xf, ss)
            if TMA:
                wg = wgu_desc.load([f0, k0])
                wu = wgu_desc.load([I + f0, k0])
            else:
                w_rows = wgu_ptr + (f0 + nn).to(tl.int64)[:, None] * stride_wgu + (k0 + kk)[None, :]
                wg = tl.load(w_rows)
                wu = tl.load(w_rows + I * stride_wgu)
            acc_g = _tile_dot(wg, xk, acc_g, INTERPRET, DOT_PREC)
            acc_u = _tile_dot(wu, xk, acc_u, INTERPRET, DOT_PREC)
        if NORM:
            scale = (1.0 / tl.sqrt_rn(tl.sum(ss, axis=1) / H + eps))[None, :]
            acc_g *= scale
            acc_u *= scale
        hv = _silu_mul_value(_round_to(acc_g, DTYPE, INTERPRET), _round_to(acc_u, DTYPE, INTERPRET), DTYPE, INTERPRET)
        tl.store(h_ptr + m.to(tl.int64)[None, :] * stride_hm + (f0 + nn)[:, None], hv.to(DTYPE), mask=m_ok[None, :])
        tl.debug_barrier()  # every thread's stores of the tile before it counts in
        tl.atomic_add(cnt_ptr + t // per_chunk, 1, sem="release", scope="gpu")
    # Down tiles: a program with fewer gate_up tiles first (q = 0 is the first of those).
    T2 = H // BLOCK_N2
    q = (pid - T1 % G + G) % G
    nn2 = tl.arange(0, BLOCK_N2)
    KC = I // CHUNKS
    for t in range(q, T2, G):
        n0 = t * BLOCK_N2
        acc = tl.zeros([BLOCK_N2, BLOCK_M], dtype=tl.float32)
        for c in range(CHUNKS):
            if SPIN == 0:  # acquire atomics in a loop
                while tl.atomic_add(cnt_ptr + c, 0, sem="acquire", scope="gpu") < per_chunk:
                    pass
            else:  # plain volatile loads (SPIN 2: a pause between), then one acquire
                while tl.load(cnt_ptr + c, volatile=True) < per_chunk:
                    if SPIN == 2:
                        tl.inline_asm_elementwise("nanosleep.u32 500; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                                  is_pure=False, pack=1)
                tl.atomic_add(cnt_ptr + c, 0, sem="acquire", scope="gpu")
            for k0 in range(c * KC, (c + 1) * KC, BLOCK_K):
                hk = tl.load(h_rows + (k0 + kk)[None, :], mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
                if TMA:
                    w = wd_desc.load([n0, k0])
                else:
                    w = tl.load(wd_ptr + (n0 + nn2).to(tl.int64)[:, None] * stride_wd + (k0 + kk)[None, :])
                acc = _tile_dot(w, hk, acc, INTERPRET, DOT_PREC)
        yv = acc.to(DTYPE)
        out = m.to(tl.int64)[None, :] * stride_ym + (n0 + nn2)[:, None]
        if RESIDUAL:
            res = tl.load(r_ptr + m.to(tl.int64)[None, :] * stride_rm + (n0 + nn2)[:, None], mask=m_ok[None, :],
                          other=0.0)
            yv = (yv.to(tl.float32) + res.to(tl.float32)).to(DTYPE)
        tl.store(y_ptr + out, yv, mask=m_ok[None, :])
    # The last program out zeroes the counters: every program is past its waits by then.
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + CHUNKS, 1, sem="acq_rel", scope="gpu") == G - 1:
        for c in range(CHUNKS):
            tl.atomic_xchg(cnt_ptr + c, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(cnt_ptr + CHUNKS, 0, sem="relaxed", scope="gpu")
