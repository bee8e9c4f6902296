"""One JSON line per job: resolved config, metrics with ``/`` namespaces, provenance.

A job's record is kept up to date in its own folder (``record.json``, rewritten whenever a
metric arrives) and appended to the shared records file when the job ends, ok, failed or
interrupted. Appends are one ``write`` under an exclusive lock, so parallel jobs
(joblib, SLURM on a shared filesystem) never interleave lines.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

STATUSES = ("running", "ok", "failed", "interrupted", "skipped")


@dataclass
class Record:
    task: str
    engine: dict[str, Any]  # the resolved engine Config: every field, same names as LLM(...)
    task_config: dict[str, Any]  # the task's own parameters (context_length, num_samples, ...)
    run: dict[str, Any]  # toolkit-level knobs: seed, budget_fraction, experiment, overrides
    provenance: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    status: str = "running"
    error: str | None = None
    start_time: str | None = None
    end_time: str | None = None
    job_dir: str | None = None

    def to_json(self) -> str:
        return json.dumps(_clean(asdict(self)), sort_keys=False)


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become null, tuples lists, unknown objects their repr."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return _clean(value.item())
    return repr(value)


def append_line(path: str | Path, line: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            fh.write(line.rstrip("\n") + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (a killed writer) is skipped."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def append_sample(path: str | Path, sample: dict[str, Any]) -> None:
    append_line(path, json.dumps(_clean(sample)))
