"""Random paged-cache fixtures shared by tests/kernels and bench_gpu (no pytest here)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import cdiv


# (Hq, Hkv, head_dim, page_size, kv_lens): B in {1, 3}; GQA groups 1, 4, 2; lengths off
# the page and block sizes.
CASES = [
    (4, 4, 16, 4, [29]),
    (8, 2, 32, 16, [37, 1, 70]),
    (6, 3, 64, 4, [5, 50, 23]),
    (8, 2, 64, 16, [100]),
    (6, 3, 32, 16, [17, 33, 2]),
]


def case_id(case) -> str:
    hq, hkv, d, ps, lens = case
    return f"hq{hq}-hkv{hkv}-d{d}-ps{ps}-b{len(lens)}"


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, d]
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int32, shuffled page ids, padding 0
    kv_lens: torch.Tensor  # [B] int32

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1]

    def slots(self, b: int) -> torch.Tensor:
        """Flat slot of each logical token of request b (int64)."""
        i = torch.arange(int(self.kv_lens[b]), device=self.page_table.device)
        return self.page_table[b].long()[i // self.page_size] * self.page_size + i % self.page_size

    def dense(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request b's K and V `[kv_len, Hkv, d]`, read through flat slots."""
        s = self.slots(b)
        return tuple(c.reshape(-1, *c.shape[2:])[s] for c in (self.k_cache, self.v_cache))


def random_paged_kv(kv_lens, num_kv_heads, head_dim, page_size, *, generator, dtype=torch.float32,
                    device="cpu", spare_pages=3, extra_cols=1, poison=True) -> PagedKV:
    """Random K/V in shuffled pages; slots no request owns are NaN when `poison`."""
    pages_per = [cdiv(n, page_size) for n in kv_lens]
    num_pages = sum(pages_per) + spare_pages
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=generator)
    v = torch.randn(shape, generator=generator)
    perm = torch.randperm(num_pages, generator=generator)
    page_table = torch.zeros(len(kv_lens), max(pages_per, default=0) + extra_cols, dtype=torch.int32)
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    used = 0
    for b, (n, p) in enumerate(zip(kv_lens, pages_per)):
        page_table[b, :p] = perm[used:used + p].int()
        used += p
        i = torch.arange(n)
        owned[page_table[b].long()[i // page_size] * page_size + i % page_size] = True
    if poison:
        k.view(-1, num_kv_heads, head_dim)[~owned] = float("nan")
        v.view(-1, num_kv_heads, head_dim)[~owned] = float("nan")
    return PagedKV(k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype),
                   page_table.to(device), torch.tensor(kv_lens, dtype=torch.int32, device=device))


def randn(*shape, generator, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| over the entries where `expected` is finite."""
    fin = torch.isfinite(expected)
    if not fin.any():
        return 0.0
    a, e = actual.float()[fin], expected.float()[fin]
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4, what: str = "") -> None:
    """Same shape, NaN/inf exactly where expected has them, relative error below `tol`."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert torch.equal(a.isnan(), e.isnan()), f"{what}: {int(a.isnan().sum())} NaN (expected {int(e.isnan().sum())})"
    inf = e.isinf() | a.isinf()
    assert torch.equal(a[inf], e[inf]), f"{what}: infinities differ"
    err = rel_err(a, e)
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.0e}"


def compile_for_gpu(kernel, helpers, types: dict, constexprs: dict, *, num_warps: int = 4, arch: int = 90,
                    options: dict | None = None, aligned: tuple = ()):
    """Compile a lazy Triton kernel for CUDA sm_`arch` without a GPU (front end, LLVM and
    the bundled ptxas), in a process where TRITON_INTERPRET is not set (Triton's own
    library functions are interpreter objects once it is imported under it): the
    interpreter runs code that the compiler may reject (a loop-carried variable changing
    shape, say). `helpers`: the kernel module's global names of the plain functions it
    calls (jitted for the compile, restored after); None: found from the kernel's code.
    `types`: Triton type strings of the runtime arguments ("*fp32", "i32", ...); every
    other argument is a constexpr from `constexprs`. `aligned`: the arguments a launch would
    find divisible by 16 (pointers 16-byte aligned, integers multiples of 16), which Triton's
    launches specialise on (wide loads): without them the build is the unspecialised one.
    Returns the compiled kernel."""
    import triton
    import triton.language
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from ._common import bind_shared_helpers, module_helpers

    fn = kernel.fn
    module = fn.__globals__
    helpers = module_helpers(fn) if helpers is None else helpers
    saved = {name: module.get(name) for name in (*helpers, "tl", "libdevice")}
    shared_saved: dict = {}
    try:
        module["tl"] = triton.language
        for f in (fn, *(getattr(module.get(h), "fn", module.get(h)) for h in helpers)):  # as LazyKernel binds them
            if f is not None:
                bind_shared_helpers(f, True, shared_saved)
        if "libdevice" in fn.__code__.co_names or any("libdevice" in getattr(module[h], "__code__", fn.__code__)
                                                       .co_names for h in helpers):
            from triton.language.extra.cuda import libdevice

            module["libdevice"] = libdevice
        for name in helpers:
            module[name] = JITFunction(getattr(module[name], "fn", module[name]))
        jitted = JITFunction(fn)
        signature = {name: types.get(name, "constexpr") for name in jitted.arg_names}
        unknown = set(types) - set(signature)
        if unknown:
            raise ValueError(f"not arguments of {fn.__name__}: {sorted(unknown)}")
        attrs = {(jitted.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
        source = ASTSource(fn=jitted, signature=signature,
                           constexprs={name: value for name, value in constexprs.items()}, attrs=attrs)
        return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, **(options or {})})
    finally:
        restore = [(module, name, value) for name, value in saved.items()]
        restore += [(mod, name, value) for (_, name), (mod, value) in shared_saved.items()]
        for mod, name, value in restore:
            if value is None:
                mod.pop(name, None)
            else:
                mod[name] = value


_PTX_CHILD = """
import importlib, json, sys
from sparseengine.kernels.testing import compile_for_gpu
out = {}
for name, b in json.loads(sys.stdin.read()).items():
    kernel = getattr(importlib.import_module(b["module"]), b["kernel"])
    options = dict(b.get("options", {}))
    out[name] = compile_for_gpu(kernel, None, b["types"], b["constexprs"], num_warps=options.pop("num_warps", 4),
                                options=options, aligned=tuple(b.get("aligned", ()))).asm["ptx"]
print(json.dumps(out))
"""


def child_env() -> dict:
    """This process's environment without TRITON_INTERPRET, the repository on PYTHONPATH:
    for a child process that compiles kernels for the GPU."""
    import os
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    return env


def ptx_in_child(builds: dict, timeout: int = 600) -> dict:
    """{name: PTX} of each build (a dict of module, kernel, types, constexprs, and optionally
    options, num_warps among them, and aligned: `compile_for_gpu`'s arguments), compiled in
    a child process without TRITON_INTERPRET."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _PTX_CHILD], input=json.dumps(builds), capture_output=True, text=True,
                         env=child_env(), timeout=timeout)
    if run.returncode:
        raise RuntimeError(f"the child's compile failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                 torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
                 torch.bool: "i1"}


class record_launches:
    """Within it, every lazy Triton kernel launch (still run, interpreted) is also recorded
    as ``{"module", "kernel", "types", "constexprs", "options"}`` (JSON-ready, duplicates
    once) in ``.launches``: what `compile_for_gpu` needs to build the same launch for a
    GPU. ``INTERPRET`` constexprs are recorded False (the compiled path)."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def __enter__(self) -> "record_launches":
        import inspect

        from . import _common

        self._orig = orig = _common.LazyKernel.__getitem__
        seen = self.launches

        def getitem(kernel, grid):
            launch = orig(kernel, grid)

            def recorded(*args, **kwargs):
                params = list(inspect.signature(kernel.fn).parameters.values())
                types, consts, options = {}, {}, {}
                for p, value in [*zip(params, args), *((next(q for q in params if q.name == k), v)
                                                       for k, v in kwargs.items() if k not in _OPTIONS)]:
                    if str(p.annotation).endswith("constexpr"):
                        consts[p.name] = False if p.name == "INTERPRET" else value
                    elif isinstance(value, torch.Tensor):
                        types[p.name] = "*" + _TRITON_TYPES[value.dtype]
                    elif type(value).__name__ == "TensorDescriptor":  # triton.tools.tensor_descriptor's
                        block = ", ".join(str(int(n)) for n in value.block_shape)
                        types[p.name] = f"tensordesc<{_TRITON_TYPES[value.base.dtype]}[{block}]>"
                    elif isinstance(value, bool):
                        types[p.name] = "i1"
                    elif isinstance(value, int):
                        types[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
                    elif isinstance(value, float):
                        types[p.name] = "fp32"
                    else:
                        consts[p.name] = value
                options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
                entry = {"module": kernel.fn.__module__, "kernel": kernel.fn.__name__, "types": types,
                         "constexprs": consts, "options": options}
                if entry not in seen:
                    seen.append(entry)
                return launch(*args, **kwargs)

            return recorded

        _common.LazyKernel.__getitem__ = getitem
        return self

    def __exit__(self, *exc) -> None:
        from . import _common

        _common.LazyKernel.__getitem__ = self._orig


_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "enable_reflect_ftz", "launch_pdl")
