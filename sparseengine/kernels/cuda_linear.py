"""The decode step's linear layers in CUDA (`cuda_linear.cu`): `y = x @ weight.T` for 1-8
bf16 rows on the H200's tensor cores, persistent CTAs (one an SM in the engine's build),
launched as a programmatic dependent launch that starts loading its weights while the kernel
before it finishes.

`cuda_linear(x, weight, *, rms_eps=None, residual=None, gated=False)` -> `[..., N]`
(gated: `[..., N / 2]`), with the model's folds: `rms_eps` the RMSNorm (of unit weight)
before the linear, `residual` the add after it (the product rounded to bf16 first), and
`gated` the SiLU-and-multiply after gate_up, whose weight rows come interleaved in groups
of `GATE_GROUP` (`interleave_gate_up`). `cuda_linear_ref` is the torch oracle: the model's
own ops (`skinny_linear_ref`, `fused_ops.silu_mul_ref`), equal to float32 rounding of the
sums (the kernel sums in another order).

It needs an sm_90 GPU and nvcc (PATH, `CUDA_HOME` or `SPARSEENGINE_NVCC`): the first call
builds the library once into `~/.cache/sparseengine/cuda/<hash>/` (`SPARSEENGINE_CACHE`).
`unavailable(device)` says why it cannot run (None when it can); the model's linears take it
where `takes` says so and fall back to the Triton kernel (`skinny_linear`) otherwise, which is
how the engine chooses by capability. A build that fails where nvcc exists raises.

Why: the Triton linears lose ~3 us a launch to ramp and tail (results/README.md); this
design, probed as scripts/cuda_gemv.cu, ran the step's chain of GEMMs 2.2% under them when
launched with PDL (cuda_gemv_h200.jsonl), and its persistent CTAs keep their next loads in
flight through a block's epilogue, where the Triton kernel's SiLU epilogue cost what it saved.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import _common
from .fused_ops import gate_up_blocks, silu_mul_ref
from .nvcc_build import build_command as nvcc_command
from .nvcc_build import load_library, on_device, require, unavailable
from .skinny_linear import skinny_linear_ref

SOURCE = Path(__file__).with_name("cuda_linear.cu")
MAX_ROWS = 8  # the MMA's n
N_MULTIPLE = 16  # a block of weight rows
GATE_GROUP = 8  # gate rows then up rows, this many each, a block (the kernel's gated epilogue)

# The model's switches (profile_decode_step.py --kernel-const sets them for A/Bs):
ENGINE = True  # its linears run this kernel where `takes` says it can (read at each call)
PDL = True  # as programmatic dependent launches (read at each call)
GATED = True  # gate_up interleaved at load, the SiLU in its epilogue (read when an engine loads its model)
# Stage x in shared memory when each CTA takes at least this many blocks of 16 rows (gate_up:
# 1792 blocks over 132 CTAs); fewer (qkv, o, down: 2-3) read it from L2. The probe at 6 rows
# (cuda_gemv_h200.jsonl, s40-5 staged against s40-6 from L2, us): gate_up 58.18 against
# 62.58, down 33.96 against 31.00, o 11.86 against 11.27, qkv 15.94 against 16.01.
STAGE_BLOCKS = 8
# The build (read at the first launch of a process; a variant builds its own library, and
# --kernel-const sets them for A/Bs): warps a CTA (they split K), 32-channel steps a warp's
# loads cover at a time, and the CTAs an SM its registers leave room for. The engine's
# build, 16 / 4 / 1, takes 122-124 registers a thread (ptxas, sm_90a): its 512 threads hold
# the whole register file, so no other kernel's CTA can run beside it on an SM, and the
# next kernel's programmatic dependent launch starts only on SMs it has left. 2 CTAs an SM
# hold a thread to 64 registers (ptxas: 400 bytes of spills at 4 steps, 60-92 at 2), and
# ran far slower on the H200 (session 45, OmniKV b=6 graph step: 19.09 / 19.10 ms at 4
# steps, 10.44 / 10.45 at 2, against 8.399 / 8.400; cuda_linear_rope_ab_s45_h200.jsonl).
# `BUILD_GRID_CTAS`: CTAs an SM in the grid (at most `BUILD_MIN_CTAS`): 8 warps x 2 or 4 x 4
# keep the engine build's warps an SM and its 122-125 registers a thread (ptxas, no spills),
# and the next kernel's launch can start where the first of an SM's CTAs has finished. Slower
# on an H100 (session 57, b=3 graph step, two rounds): Quest 8.184 / 8.185 ms at 8 x 2 and
# 8.420 / 8.421 at 4 x 4 against 8.149 / 8.150; OmniKV 8.558 / 8.559 and 8.829 / 8.832
# against 8.544 / 8.543 (results/linear_grid_s57_h100.jsonl).
BUILD_WARPS = 16
BUILD_STEPS = 4
BUILD_MIN_CTAS = 1
BUILD_GRID_CTAS = 1
# Tried and removed (session 46; results/cuda_linear_prefetch_s46_h200.jsonl, code at f1302f3
# and f505623): starting a CTA's weight stream earlier, before its griddepcontrol.wait. An
# L2 bulk prefetch of its first 64-256 KiB: OmniKV b=6 graph step 8.444-8.575 ms against
# 8.367-8.370; its second weight step loaded into registers too: 8.374 / 8.384 against
# 8.318 / 8.326 (Quest 8.100 against 8.052).


def k_multiple() -> int:
    """K must be a multiple of this in the build the constants name: each warp takes whole
    chunks of 32 * `BUILD_STEPS` channels (2048 for the engine's build)."""
    return BUILD_WARPS * 32 * BUILD_STEPS


Build = tuple[int, int, int, int]  # warps a CTA, steps, min CTAs an SM, grid CTAs an SM


def _build() -> Build:
    build = (BUILD_WARPS, BUILD_STEPS, BUILD_MIN_CTAS, BUILD_GRID_CTAS)
    if (BUILD_WARPS not in (4, 8, 16, 32) or BUILD_STEPS not in (1, 2, 4, 8) or BUILD_MIN_CTAS not in (1, 2, 3, 4)
            or not 1 <= BUILD_GRID_CTAS <= BUILD_MIN_CTAS):
        raise ValueError(f"cuda_linear build (warps, steps, min CTAs, grid CTAs) must be in (4, 8, 16, 32) x "
                         f"(1, 2, 4, 8) x (1, 2, 3, 4) x (1 .. min CTAs), got {build}")
    return build


def library() -> ctypes.CDLL:
    """The built kernel library of the build the constants name (nvcc, once a build; cached
    on disk by the source's, nvcc's and the build's hash)."""
    return _library(_build())


def build_command(nvcc: str, out: str, build: Build) -> list[str]:
    """nvcc's command line for a build (warps, steps, min CTAs, grid CTAs)."""
    return nvcc_command(nvcc, out, SOURCE, build_flags(build))


def build_flags(build: Build) -> list[str]:
    warps, steps, min_ctas, grid_ctas = build
    return [f"-DSE_WARPS={warps}", f"-DSE_STEPS={steps}", f"-DSE_MIN_CTAS={min_ctas}", f"-DSE_GRID_CTAS={grid_ctas}"]


_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
# The library's entry points as ctypes calls them (restype, argtypes), in the order of their
# `extern "C"` declarations in SOURCE (a CPU test holds the two together).
SIGNATURES = {
    "se_linear": (_I, [_P] * 4 + [_I] * 3 + [_F] + [_I] * 4 + [_P]),
    "se_linear_rope": (_I, [_P] * 3 + [_I] * 3 + [_F] + [_I] * 3 + [_P] * 2 + [_L] + [_P] * 2 + [_L] * 4
                       + [_I, _P, _I, _I, _P]),
    "se_linear_k_multiple": (_I, []),
    "se_linear_grid_ctas": (_I, []),
    "se_linear_smem": (_L, [_I] * 4),
}


@functools.lru_cache(maxsize=None)
def _library(build: Build) -> ctypes.CDLL:
    so = load_library(SOURCE, build_flags(build), "libse_linear.so", SIGNATURES, "cuda_linear")
    if so.se_linear_k_multiple() != build[0] * 32 * build[1] or so.se_linear_grid_ctas() != build[3]:
        raise RuntimeError(f"cuda_linear's library for {build} takes K in multiples of {so.se_linear_k_multiple()} "
                           f"and {so.se_linear_grid_ctas()} CTAs an SM, its build {build[0] * 32 * build[1]} and "
                           f"{build[3]}")
    return so


def fits(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes this layer: a bf16 `[N, K]` weight, N and K multiples of 16
    and `k_multiple()` (2048 in the engine's build), no bias."""
    return (bias is None and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % N_MULTIPLE == 0 and weight.shape[1] % k_multiple() == 0 and weight.shape[1] > 0)


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the model's linear layers run this kernel on `x`: `ENGINE` on, a capable GPU,
    1-`MAX_ROWS` rows of x, a layer it `fits`."""
    if not ENGINE or not x.is_cuda or x.dtype != weight.dtype or not fits(weight, bias):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return 0 < rows <= MAX_ROWS and x.shape[-1] == weight.shape[1] and unavailable(x.device) is None


def engine_linears(model, device: torch.device) -> str:
    """Which kernels a decode step's linears run (for the records): cuda_linear for batches of
    up to 8 where it runs and takes the model's layers (`rope`: qkv with the rotary embedding
    and the KV write, `cuda_linear_rope`), the Triton kernel up to
    `skinny_linear.ENGINE_MAX_ROWS` rows, cuBLAS above; on a CPU, torch."""
    from . import cuda_linear_rope, skinny_linear

    if device.type != "cuda":
        return "torch"
    triton = f"triton<={skinny_linear.ENGINE_MAX_ROWS} rows" if skinny_linear.ENGINE_MAX_ROWS > 0 else ""
    layer = model.layers[0]
    weights = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    cuda = ENGINE and unavailable(device) is None and all(fits(m.weight, m.bias) for m in weights)
    attn = layer.self_attn
    rope = (cuda_linear_rope.ENGINE and attn.d == cuda_linear_rope.HEAD_DIM and not attn.qk_norm
            and attn.qkv_proj.bias is None)  # qkv's rope epilogue, where the provider writes the paged cache
    parts = ([f"cuda<={MAX_ROWS} rows" + (" pdl" if PDL else "") + (" gated" if layer.mlp.gate_group else "")
              + (" rope" if rope else "")] if cuda else []) + ([triton] if triton else []) + ["cublas"]
    return ", ".join(parts)


def interleave_gate_up(weight: torch.Tensor, group: int = GATE_GROUP) -> torch.Tensor:
    """gate_up's `[2I, K]` rows (gate, then up) -> groups of `group` gate rows then the same
    features' up rows (the gated kernel's layout)."""
    two_i = weight.shape[0]
    if two_i % (2 * group):
        raise ValueError(f"gate_up's {two_i} rows must be a multiple of 2 x group={group}")
    return weight.reshape(2, two_i // (2 * group), group, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)


def deinterleave_gate_up(y: torch.Tensor, group: int = GATE_GROUP) -> torch.Tensor:
    """An interleaved gate_up's output `[..., 2I]` -> the model's order (gate, then up)."""
    return gate_up_blocks(y, group).transpose(-3, -2).reshape(y.shape)


def cuda_linear_ref(x, weight, *, rms_eps=None, residual=None, gated=False) -> torch.Tensor:
    """The model's ops: `skinny_linear_ref`; gated, SiLU-and-multiply of its de-interleaved output."""
    if gated:
        return silu_mul_ref(deinterleave_gate_up(skinny_linear_ref(x, weight, rms_eps=rms_eps)))
    return skinny_linear_ref(x, weight, rms_eps=rms_eps, residual=residual)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.contiguous()


def check_launch_args(x: torch.Tensor, weight, rms_eps) -> int:
    """x's rows for a launch on `weight [N, K]`, after the checks every launch shares."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a [N, K] tensor, got {getattr(weight, 'shape', type(weight).__name__)}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x must end in K={k} features (weight {tuple(weight.shape)}), got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"cuda_linear takes bf16 x and weight, got {x.dtype} and {weight.dtype}")
    rows = x.numel() // k if k else 0
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"cuda_linear takes 1 to {MAX_ROWS} rows, got {rows}")
    if n % N_MULTIPLE or k % k_multiple() or k == 0:
        raise ValueError(f"cuda_linear needs N a multiple of {N_MULTIPLE} and K of {k_multiple()}, got N={n}, K={k}")
    if rms_eps is not None and not (isinstance(rms_eps, (int, float)) and rms_eps >= 0):
        raise ValueError(f"rms_eps must be a number >= 0 or None, got {rms_eps!r}")
    return rows


def launch_plan(x: torch.Tensor, weight: torch.Tensor, rows: int, staged: bool | None, rope: bool = False) -> tuple:
    """(library, staged, x as an aligned `[rows, K]`) for a launch: x staged in shared memory
    by default where each CTA takes at least `STAGE_BLOCKS` blocks and it fits (`rope`: the
    ROPE kernel's launch, which stages its cos, sin rows too)."""
    n, k = weight.shape
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        raise ValueError("weight must be contiguous and 16-byte aligned")
    require(x.device, "cuda_linear")
    so = library()
    if staged is None:
        per_cta = (n // N_MULTIPLE) / torch.cuda.get_device_properties(x.device).multi_processor_count
        staged = per_cta >= STAGE_BLOCKS
    smem = so.se_linear_smem(rows, k, int(staged), int(rope))
    limit = torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin
    if smem > limit:
        if staged:  # x does not fit beside the partial sums: read it from L2
            staged, smem = False, so.se_linear_smem(rows, k, 0, int(rope))
        if smem > limit:
            raise ValueError(f"cuda_linear needs {smem} bytes of shared memory, the device allows {limit}")
    return so, staged, _aligned(x.reshape(rows, k))


def cuda_linear(x: torch.Tensor, weight: torch.Tensor, *, rms_eps: float | None = None,
                residual: torch.Tensor | None = None, gated: bool = False, pdl: bool | None = None,
                staged: bool | None = None) -> torch.Tensor:
    """`x [..., K]` bf16 (1-8 rows), `weight [N, K]` bf16 contiguous -> `[..., N]` bf16 on
    the current stream (gated: `[..., N / 2]`). `pdl`: a programmatic dependent launch
    (default `PDL`); `staged`: x copied into shared memory (default: when each CTA takes at
    least `STAGE_BLOCKS` blocks and it fits)."""
    rows = check_launch_args(x, weight, rms_eps)
    n, k = weight.shape
    out_n = n // 2 if gated else n
    if gated and residual is not None:
        raise ValueError("gated takes no residual (the MLP adds it after down)")
    if residual is not None and (tuple(residual.shape) != (*x.shape[:-1], n) or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {(*x.shape[:-1], n)} in {x.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"x, weight and residual must share a device, got {[str(t.device) for t in tensors]}")
    so, staged, x2 = launch_plan(x, weight, rows, staged)
    r2 = None if residual is None else _aligned(residual.reshape(rows, n))
    y = _common.empty((rows, out_n), x.dtype, x.device)
    err = on_device(x, so.se_linear, x2.data_ptr(), weight.data_ptr(), 0 if r2 is None else r2.data_ptr(),
                    y.data_ptr(), rows, n, k, float(rms_eps or 0.0), int(rms_eps is not None), int(gated), int(staged),
                    int(PDL if pdl is None else pdl), torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"cuda_linear's launch failed: error {err} (M={rows}, N={n}, K={k}, staged={staged})")
    return y.reshape(*x.shape[:-1], out_n)
