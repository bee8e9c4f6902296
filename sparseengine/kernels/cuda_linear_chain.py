"""A decode layer's o projection and MLP in one launch (`cuda_linear.cu`'s chain kernel):
what the model otherwise runs as three `cuda_linear` launches, o (+ the residual), gate_up
(the folded RMSNorm, the SiLU-and-multiply) and down (+ o's output), with a grid barrier
between the linears instead of a kernel boundary. Each CTA loads the next linear's first
weights as soon as its last block of the one before is done, so they are in flight through
the barrier. Between separate launches, the next linear's CTA can start on an SM only once
the one before has left it (a CTA holds the whole register file), and on the H200 each
linear of a sparse layer ends 3-4 us past its bytes (session 57's reading of session 56's
timelines, results/README.md).

`o_and_mlp(attn, residual, w_o, w_up, w_down, rms_eps)` -> the layer's output `[rows, N]`
(o's output plus down's, as the model's residual adds give it). Each linear's blocks are the
one-linear kernel's, summed in the same order, so the result is the three launches' bit for
bit (`o_and_mlp_ref`, the oracle, runs them). `w_up` is gate_up interleaved for the gated
epilogue (`cuda_linear.interleave_gate_up`).

The grid must be resident at once (one CTA an SM in the engine's build, or the build's
`BUILD_GRID_CTAS`): the launch checks the occupancy and fails (-4) where it is not. The
barrier's two counters live in a per-device workspace that every launch leaves as it found
it, so graph replays need no reset. The next kernel's programmatic dependent launch is let
go only after the last barrier.

`ENGINE` (read at each call) lets the model take it: off, since no GPU has run it yet
(written in session 57 with no device lent). `bash scripts/gpu_session.sh linear_grid` runs
its GPU tests and the A/B.
"""
from __future__ import annotations

import torch

from . import _common, cuda_linear

ENGINE = False
_BARRIERS: dict[int, torch.Tensor] = {}  # device index -> [2] int32, zeroed once


def takes(x: torch.Tensor, w_o: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether the model's o projection and MLP run this kernel on `x` (the attention's output):
    `ENGINE` on and `cuda_linear.takes` for each linear."""
    if not ENGINE or not cuda_linear.takes(x, w_o):
        return False
    n = w_o.shape[0]
    return (cuda_linear.fits(w_up) and cuda_linear.fits(w_down) and w_up.shape[1] == n
            and tuple(w_down.shape) == (n, w_up.shape[0] // 2) and n % cuda_linear.k_multiple() == 0)


def o_and_mlp_ref(attn, residual, w_o, w_up, w_down, rms_eps):
    """The three launches the model otherwise makes (`cuda_linear`): o with the residual,
    gate_up gated after the norm, down with o's output."""
    h = cuda_linear.cuda_linear(attn, w_o, residual=residual)
    return cuda_linear.cuda_linear(cuda_linear.cuda_linear(h, w_up, rms_eps=rms_eps, gated=True), w_down, residual=h)


def _barrier(device: torch.device) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    bar = _BARRIERS.get(index)
    if bar is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("cuda_linear_chain's barrier workspace is made at its first launch, which must not be "
                               "inside a CUDA graph capture: launch it once eagerly first")
        bar = _BARRIERS[index] = torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", index))
    return bar


def _check(attn, residual, w_o, w_up, w_down, rms_eps) -> int:
    rows = cuda_linear.check_launch_args(attn, w_o, None)
    n = w_o.shape[0]
    for name, w in (("w_up", w_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be a bf16 [rows, cols] tensor, got {getattr(w, 'shape', type(w))}")
    if w_up.shape[1] != n or w_up.shape[0] % 2 or w_down.shape != (n, w_up.shape[0] // 2):
        raise ValueError(f"the chain needs w_o [N, K], w_up [2 I, N], w_down [N, I]; got w_o {tuple(w_o.shape)}, "
                         f"w_up {tuple(w_up.shape)}, w_down {tuple(w_down.shape)}")
    mult = cuda_linear.k_multiple()
    if n % mult or (w_up.shape[0] // 2) % mult:
        raise ValueError(f"the chain needs N and I multiples of {mult} (each is a later linear's K), got "
                         f"N={n}, I={w_up.shape[0] // 2}")
    if tuple(residual.shape) != (*attn.shape[:-1], n) or residual.dtype != attn.dtype:
        raise ValueError(f"residual must be {(*attn.shape[:-1], n)} in {attn.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    if not (isinstance(rms_eps, (int, float)) and rms_eps >= 0):
        raise ValueError(f"rms_eps must be a number >= 0 (gate_up's folded norm), got {rms_eps!r}")
    tensors = (attn, residual, w_o, w_up, w_down)
    if any(t.device != attn.device for t in tensors):
        raise ValueError(f"every tensor must be on attn's device, got {[str(t.device) for t in tensors]}")
    for name, w in (("w_up", w_up), ("w_down", w_down)):
        if not w.is_contiguous() or w.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    return rows


def o_and_mlp(attn: torch.Tensor, residual: torch.Tensor, w_o: torch.Tensor, w_up: torch.Tensor,
              w_down: torch.Tensor, rms_eps: float, *, pdl: bool | None = None,
              staged: bool | None = None) -> torch.Tensor:
    """`attn [..., K]` bf16 (1-8 rows), `residual [..., N]` -> `[..., N]` on the current
    stream: `h = attn @ w_o.T + residual`, then `down(silu_mul(gate_up(RMSNorm(h)))) + h`.
    `pdl`: a programmatic dependent launch (default `cuda_linear.PDL`); `staged`: gate_up's x
    in shared memory (default: as `cuda_linear` decides for gate_up alone)."""
    rows = _check(attn, residual, w_o, w_up, w_down, rms_eps)
    n, i = w_o.shape[0], w_up.shape[0] // 2
    so, _, x2 = cuda_linear.launch_plan(attn, w_o, rows, False)  # the checks every launch shares
    h2 = _common.empty((rows, n), attn.dtype, attn.device)
    _, staged, _ = cuda_linear.launch_plan(h2, w_up, rows, staged)  # gate_up's staging, as alone
    r2 = cuda_linear._aligned(residual.reshape(rows, n))
    act = _common.empty((rows, i), attn.dtype, attn.device)
    out = _common.empty((rows, n), attn.dtype, attn.device)
    bar = _barrier(attn.device)
    err = cuda_linear.on_device(
        attn, so.se_linear_chain, x2.data_ptr(), w_o.data_ptr(), r2.data_ptr(), h2.data_ptr(), w_up.data_ptr(),
        act.data_ptr(), w_down.data_ptr(), out.data_ptr(), rows, n, w_o.shape[1], i, float(rms_eps), int(staged),
        int(cuda_linear.PDL if pdl is None else pdl), bar.data_ptr(),
        torch.cuda.current_stream(attn.device).cuda_stream)
    if err:
        why = " (its grid cannot be resident at once)" if err == -4 else ""
        raise RuntimeError(f"cuda_linear_chain's launch failed: error {err}{why} (M={rows}, N={n}, K={w_o.shape[1]}, "
                           f"I={i}, staged={staged})")
    return out.reshape(*attn.shape[:-1], n)
