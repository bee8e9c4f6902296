"""Plumbing shared by the kernel modules: lazy Triton jit, launch checks, torch helpers.

Triton is imported at the first kernel launch, never at import: both `import triton`
(its own jitted library functions) and `triton.jit` read TRITON_INTERPRET, so importing
this package before a test's conftest sets the variable is harmless, and importing it
needs no Triton at all. The kernel modules name `tl` only for type checkers;
`LazyKernel` binds it in their globals before jitting.
"""
from __future__ import annotations

import functools
import math
import operator
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # bound at first use (`gpu_wait_prior`): importing needs no Triton
    import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def int_arg(name: str, value, minimum: int = 0) -> int:
    """`value` as an int (bools and floats refused) of at least `minimum`, else a ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v}")
    return v


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class LazyKernel:
    """A `@triton.jit` kernel built at first launch: `kernel[grid](...)`. On a GPU with
    programmatic dependent launch (`pdl_enabled`), every launch asks for it: the kernel's
    blocks may start while the previous kernel in the stream drains, so each kernel's first
    statement is `wait_prior()` (tests/kernels/test_pdl.py checks that every kernel has it)."""

    def __init__(self, fn):
        self.fn = fn
        self._jitted = None

    def __getitem__(self, grid):
        if self._jitted is None:
            import triton
            import triton.language

            self.fn.__globals__["tl"] = triton.language
            if not interpreting():
                self.fn.__globals__["wait_prior"] = gpu_wait_prior()
            self._jitted = triton.jit(self.fn)
        launch = self._jitted[grid]
        return functools.partial(launch, launch_pdl=True) if pdl_enabled() else launch


def lazy_jit(fn) -> LazyKernel:
    return LazyKernel(fn)


def wait_prior():
    """A kernel's first statement: wait until the previous kernel in the stream has
    finished and its writes are visible. Compiled (`gpu_wait_prior`) it is PTX
    `griddepcontrol.wait` (a no-op for a launch without PDL), and with
    SPARSEENGINE_PDL=early also `launch_dependents` (the next kernel's blocks may launch at
    once, not when this kernel's blocks exit); under the interpreter, this: nothing."""


def _gdc_wait():
    tl.extra.cuda.gdc_wait()


def _gdc_wait_early():
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


def _gdc_none():
    pass


_gpu_wait = None


def gpu_wait_prior():
    """`wait_prior` as compiled kernels call it: jitted at first use (griddepcontrol needs
    sm_90; older GPUs get a jitted no-op)."""
    global _gpu_wait, tl
    if _gpu_wait is None:
        import triton
        import triton.language

        tl = triton.language
        sm90 = not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 9
        early = _pdl_mode() == "early"
        _gpu_wait = triton.jit((_gdc_wait_early if early else _gdc_wait) if sm90 else _gdc_none)
    return _gpu_wait


PDL_MODES = ("0", "wait", "early")
_pdl: bool | None = None


def _pdl_mode() -> str:
    mode = os.environ.get("SPARSEENGINE_PDL", "0")
    if mode not in PDL_MODES:
        raise ValueError(f"SPARSEENGINE_PDL={mode!r}; valid: {', '.join(PDL_MODES)}")
    return mode


def pdl_enabled() -> bool:
    """Launch with programmatic dependent launch: a CUDA GPU of compute capability 9.0 or
    newer, not the interpreter, and SPARSEENGINE_PDL `wait` or `early` (read once per
    process; default `0`, off: on the H200 at 7df7f4a, `early` made vanilla's b=1 graph
    step 9.02 ms against 8.86 without PDL, and Quest's b=6 9.71 against 9.59)."""
    global _pdl
    if _pdl is None:
        _pdl = (_pdl_mode() != "0" and not interpreting()
                and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)
    return _pdl


def check_launch(*tensors: torch.Tensor) -> torch.device:
    """Raise a clear error where a Triton launch cannot work; return the common device."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    try:
        import triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - Triton ships with torch on Linux
        raise RuntimeError("the Triton kernels need the `triton` package") from e
    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before the first "
            "kernel launch (use the torch reference functions otherwise)"
        )
    return device


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Every buffer a wrapper allocates goes through here (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently use TF32 tensor cores on NVIDIA; keep them exact.
    return "ieee" if dtype == torch.float32 else "tf32"


def default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def num_sms(device: torch.device) -> int:
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_cache(k_cache: torch.Tensor, num_q_heads: int, head_dim: int) -> tuple[int, int]:
    """Validate an NHD paged cache; return (page_size, num_kv_heads)."""
    if k_cache.dim() != 4 or k_cache.shape[-1] != head_dim:
        raise ValueError(f"cache must be [num_pages, page_size, Hkv, {head_dim}], got {tuple(k_cache.shape)}")
    if k_cache.stride(-1) != 1:
        raise ValueError("cache head_dim must be contiguous (stride 1)")
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    return page_size, num_kv_heads


def check_dtypes(q: torch.Tensor, *caches: torch.Tensor) -> None:
    for c in caches:
        if c.dtype != q.dtype:
            raise ValueError(f"query dtype {q.dtype} must match K/V dtype {c.dtype}")


def gather_tokens(cache: torch.Tensor, page_row: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logical tokens of one request -> `[n, Hkv, d]` (reference path)."""
    page_size = cache.shape[1]
    tokens = tokens.long()
    pages = page_row.long()[tokens // page_size]
    return cache[pages, tokens % page_size]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Plain softmax attention in fp32: q `[g, d]`, k/v `[n, d]` -> (out `[g, d]`, lse `[g]`)."""
    s = (q.float() @ k.float().T) * scale
    lse = torch.logsumexp(s, dim=-1) if s.shape[-1] else torch.full(s.shape[:-1], -math.inf, device=s.device)
    p = torch.softmax(s, dim=-1) if s.shape[-1] else s
    return p @ v.float(), lse
