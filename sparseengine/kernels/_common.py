"""Plumbing shared by the kernel modules: lazy Triton jit, launch checks, torch helpers.

Triton is imported at the first kernel launch, never at import: both `import triton`
(its own jitted library functions) and `triton.jit` read TRITON_INTERPRET, so importing
this package before a test's conftest sets the variable is harmless, and importing it
needs no Triton at all. The kernel modules name `tl` only for type checkers;
`LazyKernel` binds it in their globals before jitting.
"""
from __future__ import annotations

import functools
import inspect
import math
import operator
import os

import torch

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
    """A `@triton.jit` kernel built at first launch: `kernel[grid](...)`. Everything it calls
    is bound then: `tl` (and CUDA's libdevice where named) in its module, the plain helper
    functions of its module that it calls (and those they call, `module_helpers`) jitted in
    place, and the shared helpers of other modules (`shared_helper`) jitted into its module
    (and theirs into theirs, `bind_shared_helpers`). The interpreter calls the helpers as
    Python, so they stay plain there."""

    def __init__(self, fn):
        self.fn = fn
        self._jitted = None

    def __getitem__(self, grid):
        if self._jitted is None:
            import triton
            import triton.language

            module = self.fn.__globals__
            module["tl"] = triton.language
            helpers = module_helpers(self.fn)
            if any("libdevice" in _code_names(f) for f in (self.fn, *(module[h] for h in helpers))):
                from triton.language.extra.cuda import libdevice

                module["libdevice"] = libdevice
            compiled = not interpreting()
            for name in helpers:
                if compiled and not hasattr(module[name], "fn"):  # another kernel may have jitted it
                    module[name] = triton.jit(module[name])
            for f in (self.fn, *(module[h] for h in helpers)):  # shared helpers the module's helpers call too
                bind_shared_helpers(getattr(f, "fn", f), compiled)
            self._jitted = triton.jit(self.fn)
        return self._jitted[grid]


def bind_shared_helpers(fn, compiled: bool, saved: dict | None = None) -> None:
    """Bind the shared helpers `fn` calls, and those they call, into the modules that call
    them (jitted when `compiled`; the interpreter calls them as Python, with `tl` bound).
    `saved`: receives ``(module id, name) -> (module, previous value)`` to undo it."""
    import triton
    import triton.language

    for name, helper in SHARED_HELPERS.items():
        if name not in fn.__code__.co_names:
            continue
        helper.__globals__["tl"] = triton.language
        if "tlc" in helper.__code__.co_names:  # griddepcontrol (pdl.pdl_trigger)
            import triton.language.extra.cuda

            helper.__globals__["tlc"] = triton.language.extra.cuda
        if compiled:
            module = fn.__globals__
            if saved is not None:
                saved.setdefault((id(module), name), (module, module.get(name)))
            if name not in _jitted_helpers:
                _jitted_helpers[name] = triton.jit(helper)
            module[name] = _jitted_helpers[name]
        bind_shared_helpers(helper, compiled, saved)


def _code_names(fn) -> tuple:
    code = getattr(getattr(fn, "fn", fn), "__code__", None)  # through a jitted helper
    return code.co_names if code is not None else ()


def module_helpers(fn) -> list[str]:
    """The global names of the plain functions of `fn`'s module that `fn` calls, and of those
    they call: a compiled kernel needs them jitted (an already-jitted one counts too)."""
    module, found, todo = fn.__globals__, [], [fn]
    while todo:
        for name in _code_names(todo.pop()):
            value = module.get(name)
            value = getattr(value, "fn", value)
            if inspect.isfunction(value) and value.__module__ == fn.__module__ and name not in found:
                found.append(name)
                todo.append(value)
    return found


SHARED_HELPERS: dict = {}  # name -> plain function that kernels of several modules call
_jitted_helpers: dict = {}


def shared_helper(fn):
    """Register a plain function that kernels of several modules call (e.g. the online
    softmax step): `LazyKernel` jits it into each calling kernel's module at the first
    launch, where the compiler inlines it; the interpreter runs it as Python."""
    SHARED_HELPERS[fn.__name__] = fn
    return fn


def lazy_jit(fn) -> LazyKernel:
    return LazyKernel(fn)


def check_scores(scores, dims: tuple[int, ...], shape: str) -> None:
    """A ValueError unless `scores` is a floating tensor of one of `dims` dimensions
    (`shape` names them in the message)."""
    if not isinstance(scores, torch.Tensor) or scores.dim() not in dims or not scores.is_floating_point():
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        dtype = f", dtype {scores.dtype}" if isinstance(scores, torch.Tensor) else ""
        raise ValueError(f"scores must be a floating {shape} tensor, got {got}{dtype}")


def check_lens(kv_lens, B: int) -> None:
    """A ValueError unless `kv_lens` is an integer [B] tensor."""
    if (not isinstance(kv_lens, torch.Tensor) or kv_lens.dim() != 1 or kv_lens.shape[0] != B
            or kv_lens.is_floating_point() or kv_lens.dtype == torch.bool):
        got = (f"shape {tuple(kv_lens.shape)}, dtype {kv_lens.dtype}" if isinstance(kv_lens, torch.Tensor)
               else type(kv_lens).__name__)
        raise ValueError(f"kv_lens must be an integer [B={B}] tensor, got {got}")


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


class ArrivalCounters:
    """One owner's int32 arrival counters (a kernel whose last program to arrive finishes
    the work), `size` of them a device: zeroed once, at a fixed address that CUDA-graph
    replays reuse, each launch leaving them at zero again. An engine keeps its own (the
    sampler's, the attention provider's), so that two engines replaying on two streams of
    one GPU never share them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._by_device:
            self._by_device[device] = torch.zeros(self.size, dtype=torch.int32, device=device)
        return self._by_device[device]


def check_counters(counters, at_least: int, device: torch.device, what: str) -> None:
    """A ValueError unless caller-given arrival `counters` are a contiguous int32 vector of
    at least `at_least` entries on `device` (`what`: how the message names that count)."""
    if (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32 or counters.dim() != 1
            or counters.numel() < at_least or counters.stride(0) != 1 or counters.device != device):
        raise ValueError(f"counters must be a contiguous int32 vector of at least {what} on {device}, got "
                         f"{describe(counters)}")


def describe(t) -> str:
    """A value for an error message: a tensor's shape, dtype and device, else its type."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


_shared_counters: dict[str, ArrivalCounters] = {}


def zeroed_counters(owner: str, size: int, device: torch.device) -> torch.Tensor:
    """The counters shared by every caller of kernel `owner` that passes none of its own
    (`ArrivalCounters`): launches running at once on two streams of one device must not
    use them."""
    if owner not in _shared_counters:
        _shared_counters[owner] = ArrivalCounters(size)
    return _shared_counters[owner].on(device)


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
