"""The W&B logger runs offline without an API key and always finishes."""

from __future__ import annotations

from experiments.loggers.wandb_logger import WandbLogger
from experiments.records import Record


def test_offline_run_logs_and_finishes(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = WandbLogger(dir=str(tmp_path))
    assert logger.mode == "offline"
    rec = Record(task="passkey", engine={"sparse_method": "vanilla", "model": "tiny-llama", "budget": 64},
                 task_config={"context_length": 256}, run={"seed": 0}, provenance={})
    logger.start(rec)
    logger.log_metrics({"passkey/score": 50.0}, rec)
    logger.log_table("passkey/samples", [{"index": 0, "score": 0.5}])
    rec.status = "ok"
    logger.finish(rec)
    assert logger._run is None
    assert list(tmp_path.glob("wandb/offline-run-*"))
