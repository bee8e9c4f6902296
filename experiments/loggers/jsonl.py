"""Local JSON-lines records: the job's ``record.json`` kept current, one line appended at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from experiments.loggers.base import Logger
from experiments.records import Record, append_line, write_atomic


class JsonlLogger(Logger):
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._job_file: Path | None = None

    def start(self, record: Record) -> None:
        if record.job_dir:
            self._job_file = Path(record.job_dir) / "record.json"
            write_atomic(self._job_file, record.to_json())

    def log_metrics(self, metrics: dict[str, Any], record: Record) -> None:
        if self._job_file is not None:
            write_atomic(self._job_file, record.to_json())

    def finish(self, record: Record) -> None:
        line = record.to_json()
        if self._job_file is not None:
            write_atomic(self._job_file, line)
        append_line(self.path, line)
