"""Where a record came from: git commit and dirty flag, device, package versions, host."""

from __future__ import annotations

import importlib.metadata
import platform
import socket
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "triton", "flashinfer-python", "hydra-core", "omegaconf", "wandb", "sparseengine")
REPO = Path(__file__).resolve().parent.parent


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """The checkout's commit and dirty flag. ``SPARSEENGINE_GIT_COMMIT`` /
    ``SPARSEENGINE_GIT_DIRTY``, when set by whoever copied the tree (a GPU machine's copy
    has no ``.git``, or a stale one), take precedence, and ``git_source`` says so."""
    if os.environ.get("SPARSEENGINE_GIT_COMMIT"):  # explicit: a copy may carry a stale .git
        dirty = os.environ.get("SPARSEENGINE_GIT_DIRTY")
        return {"git_commit": os.environ["SPARSEENGINE_GIT_COMMIT"],
                "git_dirty": None if dirty is None else dirty == "1", "git_source": "environment"}
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain")
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_info() -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        return {"device": "cuda", "device_name": torch.cuda.get_device_name(0),
                "device_count": torch.cuda.device_count()}
    return {"device": "cpu", "device_name": platform.processor() or platform.machine(),
            "device_count": torch.get_num_threads()}


def collect() -> dict[str, Any]:
    return {**git_state(), **device_info(), "hostname": socket.gethostname(),
            "python": platform.python_version(), "packages": package_versions()}
