"""Weights & Biases: the same metrics (``/`` namespaces), a results table, offline without a key."""

from __future__ import annotations

import os
from typing import Any

from experiments.loggers.base import Logger
from experiments.records import Record


class WandbLogger(Logger):
    def __init__(self, project: str = "sparseengine", entity: str | None = None, group: str | None = None,
                 mode: str | None = None, dir: str = "runs", tags: list[str] | None = None) -> None:
        self.project, self.entity, self.group, self.dir = project, entity, group, dir
        self.tags = list(tags or [])
        # No API key and no explicit mode: log offline (sync later with `wandb sync`).
        self.mode = mode or os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self._run = None

    def start(self, record: Record) -> None:
        import wandb

        os.makedirs(self.dir, exist_ok=True)
        e = record.engine
        name = f"{record.task}-{e.get('sparse_method')}-{e.get('model')}-b{e.get('budget')}"
        config = {**e, **{f"task.{k}": v for k, v in record.task_config.items()}, **record.run}
        self._run = wandb.init(project=self.project, entity=self.entity, group=self.group, mode=self.mode,
                               dir=self.dir, name=name, config=config, tags=self.tags, reinit="finish_previous")

    def log_metrics(self, metrics: dict[str, Any], record: Record) -> None:
        if self._run is not None:
            self._run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))})

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        if self._run is None or not rows:
            return
        import wandb

        columns = sorted({k for row in rows for k in row})
        data = [[_cell(row.get(c)) for c in columns] for row in rows]
        self._run.log({name: wandb.Table(columns=columns, data=data)})

    def finish(self, record: Record) -> None:
        if self._run is None:
            return
        try:
            self._run.summary.update({"status": record.status, "error": record.error or ""})
        finally:
            self._run.finish(exit_code=0 if record.status in ("ok", "skipped") else 1)
            self._run = None


def _cell(value: Any) -> Any:
    return value if value is None or isinstance(value, (int, float, str, bool)) else str(value)
