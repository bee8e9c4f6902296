"""Where a CUDA kernel's spills land: its sm_90a machine code's loops, each with its
instruction count, its tensor-core instructions (HMMA) and its local-memory spill
instructions (LDL / STL). ptxas's report (`nvcc_build.ptxas_usage`) counts a build's spill
bytes; this says whether they sit inside a hot loop or outside it (session 57 read the
linear chain's with it: 22-55 spill instructions inside its gate_up loop, then none).

    python scripts/sass_loops.py sparseengine/kernels/cuda_linear.cu [-D...] [--kernel REGEX]

It builds a cubin with nvcc (`nvcc_build.build_command`) and disassembles it with cuobjdump, which
needs nvdisasm beside it or on PATH; neither comes with the CUDA pieces this machine has,
but both are on PyPI and run on a CPU: `pip download --no-deps nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm`, unzip the wheels, and put their `nvidia/cu13/bin` on PATH (or set
SPARSEENGINE_CUOBJDUMP to cuobjdump's path). A loop is a backward branch's range.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")


def parse(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) for each instruction of a `cuobjdump -sass` listing."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.search, sass.splitlines()) if m]


def loops(instrs: list[tuple[int, str]]) -> list[dict]:
    """One row a backward branch (`BRA` to a lower address): its range, its instructions, the
    HMMA among them and its spill instructions (LDL / STL), innermost ranges first."""
    out = []
    for addr, text in instrs:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            body = [t for a, t in instrs if lo <= a <= addr]
            out.append({"start": lo, "end": addr, "instructions": len(body),
                        "hmma": sum("HMMA" in t for t in body),
                        "spills": sum(bool(re.match(r"(@!?P\d\s+)?(LDL|STL)\b", t)) for t in body)})
    return sorted(out, key=lambda r: r["end"] - r["start"])


def cuobjdump() -> str:
    found = os.environ.get("SPARSEENGINE_CUOBJDUMP") or shutil.which("cuobjdump")
    if not found:
        raise SystemExit("no cuobjdump: see this script's docstring (the PyPI wheels nvidia-cuda-cuobjdump and "
                         "nvidia-cuda-nvdisasm run on a CPU)")
    return found


def main(argv: list[str]) -> None:
    from sparseengine.kernels.nvcc_build import build_command, find_nvcc

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("--kernel", default=".", help="a regex the kernels' mangled names must match")
    args, flags = ap.parse_known_args(argv)
    nvcc, tool = find_nvcc(), cuobjdump()
    if nvcc is None:
        raise SystemExit("no nvcc")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = f"{tmp}/k.cubin"
        subprocess.run(build_command(nvcc, cubin, Path(args.source), flags, cubin=True), check=True)
        listing = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        names = [n for n in re.findall(r"Function : (\S+)", listing) if re.search(args.kernel, n)]
        for name in names:
            sass = subprocess.run([tool, "-sass", "-fun", name, cubin], capture_output=True, text=True,
                                  check=True).stdout
            print(name)
            for r in loops(parse(sass)):
                if r["hmma"] or r["spills"]:
                    print(f"  loop {r['start']:#x}-{r['end']:#x}: {r['instructions']} instructions, "
                          f"{r['hmma']} HMMA, {r['spills']} spill instructions")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
