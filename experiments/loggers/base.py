"""The logger interface ``run.py`` drives: start, metrics as they arrive, a table, finish."""

from __future__ import annotations

from typing import Any

from experiments.records import Record


class Logger:
    def start(self, record: Record) -> None:
        pass

    def log_metrics(self, metrics: dict[str, Any], record: Record) -> None:
        pass

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        pass

    def finish(self, record: Record) -> None:
        """Called exactly once, in ``finally``, whatever the job's status."""
