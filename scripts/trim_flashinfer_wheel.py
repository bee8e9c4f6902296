"""Write a smaller FlashInfer wheel that still carries what the FlashInfer provider
builds (the FA2 paged decode and prefill JIT modules): every file but CUDA sources outside
`data/`, the top-level CUDA sources of `data/csrc`, and the headers (`data/include`,
cutlass, cccl, spdlog). The kernel sources of other modules (MoE, the experimental and
Blackwell kernels) are dropped; a module that needs them fails to build on a trimmed
install. The device tool carries at most 64 MiB a call: the full wheel (59 MiB) with
apache-tvm-ffi left no room for the repository; the trimmed one is 29 MiB. Usage (then copy the
apache-tvm-ffi wheel beside the trimmed one):

    python scripts/trim_flashinfer_wheel.py .whl/flashinfer/flashinfer_python-*.whl .whl/flashinfer_trim/
"""
from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

HEADERS = ("include", "cutlass", "cccl", "spdlog")
CODE = (".py", ".pyi", "py.typed")


def keep(name: str) -> bool:
    parts = name.split("/")
    if parts[0] != "flashinfer" or name.endswith(CODE):
        return True
    if parts[1] != "data":
        return not name.endswith((".cu", ".cuh"))  # kernel sources beside other modules' Python
    if parts[2] == "csrc":
        return len(parts) == 4  # top-level sources only
    return len(parts) == 3 or parts[2] in HEADERS


def trim(src: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    record, lines = None, []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record = info.filename
            elif keep(info.filename):
                data = zin.read(info.filename)
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                lines.append(f"{info.filename},sha256={digest},{len(data)}")
        if record is None:
            raise SystemExit(f"{src} has no RECORD: not a wheel")
        zout.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    dst = trim(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{dst}: {dst.stat().st_size / 2**20:.1f} MiB")
