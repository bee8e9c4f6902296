"""The index of each row's largest value (greedy sampling over a decode step's logits).

`row_argmax_ref(x)` is `torch.argmax(x, -1)`, the oracle: the first index of the row's
maximum, a NaN counting as larger than every number (the first NaN wins).
`row_argmax_triton(x)` has its contract on `[B, V]` float rows. torch's argmax took 27 us a
step at 6 rows x 128256 on the H200 (its reduce kernel in profile_quest_b6). Here a row is
cut into chunks of `block` values, one program each (first index of the chunk's maximum,
or of its first NaN); the last program of a row to finish (an atomic count per row, left
at zero for the next launch) reduces the row's chunks in index order. One launch, no host
sync: CUDA-graph capturable. The counters are the caller's (`counters`, int32 zeros, at
least B; each launch leaves them at zero) or else one buffer per device: launches that
share counters must not run at once on two streams (two engines, each replaying its own
graph on its own stream, each pass their own: the sampler owns one). In the Quest b=6
decode step on the H200 it took 5.4 us a step against torch's 27.2 (session 21,
`ab_switches_h200.jsonl`); the sampler takes it with SAMPLER_USES_KERNEL.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _common
from ._common import cdiv, check_launch, int_arg, lazy_jit, next_pow2

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl

MAX_ROWS = 1024  # rows a launch may count (its per-row counters, zeroed once per device)
# Whether greedy sampling (layers/sampler.py) runs this kernel on a GPU (read at each call:
# profile_decode_step.py --kernel-const A/Bs it against torch's argmax). A/B session 21
# (results/ab_switches_h200.jsonl): Quest b=6 step -0.020 ms, vanilla b=1 -0.025.
SAMPLER_USES_KERNEL = True


def row_argmax_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.argmax(x, dim=-1)


def row_argmax_triton(x: torch.Tensor, *, block: int = 4096, num_warps: int = 4,
                      counters: torch.Tensor | None = None) -> torch.Tensor:
    """`x [B, V]` floating -> int64 `[B]`. `block`: values a program (a power of two >= 16);
    `counters`: the per-row arrival counters to use (int32 zeros on x's device, at least B),
    default the device's shared buffer."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [B, V] tensor, got {_common.describe(x)}")
    B, V = x.shape
    if V == 0:
        raise ValueError("x must have at least one column (argmax of an empty row)")
    if B > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows a launch, got {B}")
    if int_arg("block", block, 16) & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    device = check_launch(x)
    if counters is None:
        counters = _common.zeroed_counters("row_argmax", MAX_ROWS, device)
    else:
        _common.check_counters(counters, B, device, str(B))
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((B,), dtype=torch.int64, device=device)
    if B == 0:
        return out
    block = min(block, max(16, next_pow2(V)))
    chunks = cdiv(V, block)
    part_val = _common.empty((B, chunks), torch.float32, device)
    part_idx = torch.empty((B, chunks), dtype=torch.int64, device=device)
    part_nan = torch.empty((B, chunks), dtype=torch.int32, device=device)
    _row_argmax_kernel[(chunks, B)](
        x, out, part_val, part_idx, part_nan, counters, V,
        x.stride(0), chunks,
        BLOCK=block, BLOCK_C=max(16, next_pow2(chunks)), num_warps=num_warps)
    return out


def _first_max(val, idx, nan, ok):
    """(index, value, any NaN) of the first maximum of `val` where `ok`, a NaN (`nan`)
    counting as the largest: `idx` ascends, so the first is the smallest index."""
    big = tl.full(idx.shape, 9223372036854775807, tl.int64)
    has_nan = tl.max((ok & nan).to(tl.int32), 0)
    best = tl.max(tl.where(ok & ~nan, val, float("-inf")), 0)
    first_nan = tl.min(tl.where(ok & nan, idx, big), 0)
    first_best = tl.min(tl.where(ok & ~nan & (val == best), idx, big), 0)
    return tl.where(has_nan > 0, first_nan, first_best), best, has_nan


@lazy_jit
def _row_argmax_kernel(x_ptr, out_ptr, val_ptr, idx_ptr, nan_ptr, counter_ptr, V, stride_x, chunks,
                       BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    v = tl.load(x_ptr + b.to(tl.int64) * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    idx, best, has_nan = _first_max(v, offs.to(tl.int64), v != v, ok)
    part = b * chunks + c
    tl.store(val_ptr + part, best)
    tl.store(idx_ptr + part, idx)
    tl.store(nan_ptr + part, has_nan)
    # Every thread's stores before the release; the acquire of the row's last program then
    # sees all the row's chunks.
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr + b, 1, sem="acq_rel", scope="gpu") == chunks - 1:
        cs = tl.arange(0, BLOCK_C)
        c_ok = cs < chunks
        vals = tl.load(val_ptr + b * chunks + cs, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(idx_ptr + b * chunks + cs, mask=c_ok, other=0, cache_modifier=".cg")
        nans = tl.load(nan_ptr + b * chunks + cs, mask=c_ok, other=0, cache_modifier=".cg") > 0
        # a chunk's best is -inf when all it holds is -inf or NaN: its index still counts in order
        first, _, _ = _first_max(vals, idxs, nans, c_ok)
        tl.store(out_ptr + b, first)
        tl.atomic_xchg(counter_ptr + b, 0, sem="relaxed", scope="gpu")  # ready for the next launch
