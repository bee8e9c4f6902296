"""A task's reference pass kept on disk, so the jobs of a sweep that share a reference compute it
once (the fidelity task: vanilla's outputs on the job's prompts are the same for every method
and budget of a sweep, and took about half of each job's time).

``ReferenceCache(root)`` (``root`` None: no cache) keys an entry by everything the reference
depends on (``reference_key``): the reference engine's resolved ``Config`` without the fields
that only a sparse method reads (``METHOD_FIELDS``: a sweep's budgets and knobs, which the dense
reference ignores), its model files, the task's parameters, the prompts' token ids, the
engine's source code (``source_digest``: a hash of the package's files, so an edit, committed
or not, is a new key), torch's version and the device type. ``load(key)`` gives the stored entry or None; ``save``
writes it whole (a temporary file renamed), so a job reading beside one writing never sees half
an entry. Entries hold tensors, numbers and lists only (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

import sparseengine

METHOD_FIELDS = ("sink_tokens", "recent_tokens", "budget", "method_knobs")
FORMAT = 1  # the entries' layout: a change makes every earlier entry a miss
SOURCES = (Path(sparseengine.__file__).resolve().parent, Path(__file__).resolve().parent)  # the engine, the tasks


def source_digest(roots: tuple[Path, ...] = SOURCES) -> str:
    """A hash of every .py, .cu and .json file under `roots` (their paths and bytes)."""
    return _digest(tuple(str(r) for r in roots))


@functools.lru_cache(maxsize=None)
def _digest(roots: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for root in map(Path, roots):
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cu", ".json") and p.is_file()):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def weights_identity(folder: Path | None) -> list[tuple[str, int, int]]:
    """The model folder's files as (name, size, mtime in ns); [] for dummy weights (no folder:
    the config's seed makes them)."""
    if folder is None:
        return []
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(Path(folder).iterdir()) if f.is_file()]


def reference_key(config: dict[str, Any], task: dict[str, Any], prompts: list[list[int]], device: str,
                  weights: list | None = None) -> str:
    """The key of a reference pass: `config` the reference engine's resolved Config
    (``Config.to_dict()``), `task` its task's parameters, `prompts` the token ids it ran on,
    `weights` its model files (``weights_identity``: another file under the same model name,
    e.g. a new package of the embedded model, is another key)."""
    parts = {"format": FORMAT, "config": {k: v for k, v in config.items() if k not in METHOD_FIELDS},
             "task": task, "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
             "weights": weights or [], "code": source_digest(), "torch": torch.__version__,
             "device": torch.device(device).type}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


class ReferenceCache:
    def __init__(self, root: str | Path | None) -> None:
        self.root = Path(root) if root else None

    def path(self, key: str) -> Path | None:
        return None if self.root is None else self.root / f"{key}.pt"

    def load(self, key: str) -> dict[str, Any] | None:
        path = self.path(key)
        if path is None or not path.exists():
            return None
        return torch.load(path, weights_only=True)

    def save(self, key: str, entry: dict[str, Any]) -> None:
        path = self.path(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        torch.save(entry, tmp)
        os.replace(tmp, path)
