"""Building and loading the CUDA C kernels (`cuda_linear.cu`, `quest_select.cu`, `quest_scores.cu`,
`sparse_attention.cu`, `omnikv_select.cu`) with nvcc; `ptxas_usage(source, flags)` is ptxas's
register and spill report of a build.

`unavailable(device)` says why such a kernel cannot run there (None when it can: an sm_90
GPU and nvcc), `require(device, what)` raises with it; `on_device(x, launch, *args)` calls a
library entry point with x's device current. `find_nvcc()` finds nvcc (`SPARSEENGINE_NVCC`,
PATH, `CUDA_HOME`/`CUDA_PATH`, /usr/local/cuda). `load_library(source, flags, name,
signatures)` builds `source` once per (source text, the headers beside it, nvcc, flags) into
`~/.cache/sparseengine/cuda/<hash>/<name>` (`SPARSEENGINE_CACHE`) and loads it with ctypes,
each entry point typed from `signatures` ({name: (restype, argtypes)}, in the order of the
source's `extern "C"` declarations: a CPU test holds each table to its source,
`declared_signatures`). A build that fails raises with nvcc's message. No GPU is needed to
build or load a library. For probes that time a kernel stage by stage: `patch_once(text, old,
new, what)` and `patched_copy(source, patched, folder)`, a copy of a source and its headers
with some of them rewritten.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

ARCH = "sm_90a"


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for cand in (os.environ.get("SPARSEENGINE_NVCC"), shutil.which("nvcc"),
                 home and os.path.join(home, "bin", "nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


@functools.lru_cache(maxsize=None)
def _device_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"built for {ARCH}: needs compute capability 9.0, got {cap[0]}.{cap[1]}"
    if find_nvcc() is None:
        return "no nvcc to build it (PATH, CUDA_HOME/bin, /usr/local/cuda/bin or SPARSEENGINE_NVCC)"
    return None


def unavailable(device: torch.device | str) -> str | None:
    """Why a kernel built here cannot run on `device` (None: it can; its first launch builds it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _device_reason(device)


def require(device: torch.device | str, what: str) -> None:
    """Raises RuntimeError naming `what` where a kernel built here cannot run on `device`."""
    reason = unavailable(device)
    if reason is not None:
        raise RuntimeError(f"{what} cannot run: {reason}")


def on_device(x: torch.Tensor, launch, *args) -> int:
    """`launch(*args)` (a library entry point, -> its error code) with x's device current:
    a library launches on, and sizes for, the current device."""
    if x.device.index is None or x.device.index == torch.cuda.current_device():
        return launch(*args)
    with torch.cuda.device(x.device):
        return launch(*args)


def build_command(nvcc: str, out: str, source: Path, flags: list[str], cubin: bool = False) -> list[str]:
    """nvcc's command line: a shared library for `ARCH` with the build's `-D` flags (`cubin`:
    the device code alone, for ptxas's report or a disassembly)."""
    kind = ["-cubin"] if cubin else ["-shared", "-Xcompiler", "-fPIC"]
    return [nvcc, "-O3", f"-arch={ARCH}", *kind, *flags, "-o", out, str(source)]


def load_library(source: Path, flags: list[str], name: str, signatures: dict, what: str) -> ctypes.CDLL:
    """The built library (`what` names the kernel in errors); the caller caches it."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError(f"{what} needs nvcc: none on PATH, in CUDA_HOME/bin or /usr/local/cuda/bin "
                           "(or set SPARSEENGINE_NVCC)")
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.cuh")))  # what a source may include
    key = hashlib.sha256(source.read_bytes() + headers + nvcc.encode() + ARCH.encode()
                         + repr(flags).encode()).hexdigest()[:16]
    root = Path(os.environ.get("SPARSEENGINE_CACHE", Path.home() / ".cache" / "sparseengine"))
    lib = root / "cuda" / key / name
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
        cmd = build_command(nvcc, str(tmp), source, flags)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{what}: nvcc failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
        os.replace(tmp, lib)  # atomic: a process building beside this one finds a whole file
    so = ctypes.CDLL(str(lib))
    for entry, (restype, argtypes) in signatures.items():
        getattr(so, entry).restype, getattr(so, entry).argtypes = restype, argtypes
    return so


def patch_once(text: str, old: str, new: str, what: str) -> str:
    """`text` with `old` replaced by `new`; raises ValueError unless `old` occurs exactly once
    (a probe's patch that no longer matches its kernel's source must stop it)."""
    if text.count(old) != 1:
        raise ValueError(f"patch does not match {what} once ({text.count(old)} times): {old[:60]!r}")
    return text.replace(old, new)


def patched_copy(source: Path, patched: dict[str, str], folder: Path) -> Path:
    """`source` and the headers beside it copied into `folder`, each file that `patched` names
    ({file name: text}) written with its text instead; -> the copy of `source`, for
    `load_library` or `ptxas_usage`."""
    files = {f.name: f for f in [source, *source.parent.glob("*.cuh")]}
    unknown = set(patched) - set(files)
    if unknown:
        raise ValueError(f"patched names files that are not {source.name} or a header beside it: {sorted(unknown)}")
    folder.mkdir(parents=True, exist_ok=True)
    for name, f in files.items():
        (folder / name).write_text(patched[name] if name in patched else f.read_text())
    return folder / source.name


def ptxas_usage(source: Path, flags: list[str]) -> dict[str, dict[str, int]]:
    """ptxas's report for each kernel and device function of a build (`-Xptxas -v`, no
    library written): {mangled name: {"registers", "stack", "spill_stores", "spill_loads"}}
    (bytes; registers where ptxas names them). Raises where nvcc is missing or fails."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("ptxas_usage needs nvcc")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = build_command(nvcc, f"{tmp}/k.cubin", source, [*flags, "-Xptxas", "-v"], cubin=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    usage, last = {}, None  # ptxas names a function, then its frame and spills, then (kernels) its registers
    for line in done.stderr.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            last = usage.setdefault(m.group(1), {"registers": 0})
        elif last is not None and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                                  r"(\d+) bytes spill loads", line)):
            last.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif last is not None and (m := re.search(r"Used (\d+) registers", line)):
            last["registers"] = int(m.group(1))
    return usage


def declared_signatures(source: Path) -> dict:
    """The source's `extern "C"` entry points as ctypes signatures (for the tests that hold a
    wrapper's table to its source: a float passed without one fails at the call, a pointer
    passed as an int is truncated)."""
    ctype = {"int": ctypes.c_int, "long long": ctypes.c_longlong, "float": ctypes.c_float}
    declared = {}
    for ret, entry, params in re.findall(r'extern "C" (long long|int) (\w+)\(([^)]*)\)', source.read_text()):
        args = [" ".join(p.split()[:-1]) for p in params.split(",") if p.strip()]
        declared[entry] = (ctype[ret], [ctypes.c_void_p if a.endswith("*") else ctype[a] for a in args])
    return declared
