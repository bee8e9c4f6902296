"""run_job in-process: budget_fraction, an interrupted job keeps what it measured, dense
jobs in a budget sweep are measured once, a failing logger does not lose the record."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from experiments.job import resolve_engine, run_job
from experiments.records import read_records
from experiments.tasks.passkey import PasskeyTask
from tests.toolkit.conftest import compose


@dataclass
class InterruptedTask(PasskeyTask):
    name: str = "interrupted"

    def run(self, env):
        env.log({"interrupted/first": 1.0})
        raise KeyboardInterrupt


def _cfg(tmp_path, *extra):
    return compose(["debug=tiny", f"records_path={tmp_path / 'r.jsonl'}", *extra])


def test_budget_fraction_sets_budget(tmp_path) -> None:
    cfg = _cfg(tmp_path, "budget_fraction=0.5", "engine.sink_tokens=16", "engine.recent_tokens=32")
    assert resolve_engine(cfg)["budget"] == 256 // 2 - 16 - 32
    with pytest.raises(ValueError, match="fewer than sink_tokens"):
        resolve_engine(_cfg(tmp_path, "budget_fraction=0.125"))  # 32 tokens < 64 + 512


def test_budget_fraction_sets_recent_tokens_for_a_method_without_budget(tmp_path) -> None:
    """StreamingLLM leaves ``budget`` unused (METHODS.md): its total is sink + recent, so a
    fraction sets ``recent_tokens``; the summary tables count what it held."""
    import pandas as pd

    from experiments.aggregate import lane, total_budget

    cfg = _cfg(tmp_path, "sparse_method=streamingllm", "budget_fraction=0.5", "engine.sink_tokens=16")
    engine = resolve_engine(cfg)
    assert (engine["recent_tokens"], engine["budget"]) == (256 // 2 - 16, 0)
    row = pd.Series({"sparse_method": "streamingllm", "sink_tokens": 16, "budget": 999, "recent_tokens": 64,
                     "prefill_sparse_method": "none"})
    assert total_budget(row) == 80 and lane(row) == "streamingllm (total 80)"
    with pytest.raises(ValueError, match=r"fewer than sink_tokens \(64\)"):
        resolve_engine(_cfg(tmp_path, "sparse_method=streamingllm", "budget_fraction=0.125"))  # 32 < 64


def test_interrupt_keeps_measured_metrics(tmp_path) -> None:
    cfg = _cfg(tmp_path, "task._target_=tests.toolkit.test_job.InterruptedTask", "task.name=interrupted")
    with pytest.raises(KeyboardInterrupt):
        run_job(cfg)
    (rec,) = read_records(tmp_path / "r.jsonl")
    assert rec["status"] == "interrupted" and rec["metrics"] == {"interrupted/first": 1.0}


def test_dense_method_is_measured_once_in_a_budget_sweep(tmp_path) -> None:
    cfg = _cfg(tmp_path, "budget_fraction=1.0", "dense_budget_fraction=0.5", "engine.sink_tokens=0",
               "engine.recent_tokens=0")
    run_job(cfg)
    (rec,) = read_records(tmp_path / "r.jsonl")
    assert rec["status"] == "skipped" and "dense" in rec["error"]


def test_broken_logger_does_not_lose_the_record(tmp_path) -> None:
    cfg = _cfg(tmp_path, "task._target_=tests.toolkit.test_job.InterruptedTask",
               "+logger.broken._target_=tests.toolkit.test_job.BrokenLogger")
    with pytest.raises(KeyboardInterrupt):
        run_job(cfg)
    assert len(list(read_records(tmp_path / "r.jsonl"))) == 1


class BrokenLogger:
    def start(self, record):
        pass

    def log_metrics(self, metrics, record):
        pass

    def log_table(self, name, rows):
        pass

    def finish(self, record):
        raise RuntimeError("logger down")


def test_total_budget_in_tokens(tmp_path) -> None:
    """``total_budget`` sets the same knobs as a fraction, in tokens (the 128K decode
    benchmark's total 2048 for every method, StreamingLLM included)."""
    engine = resolve_engine(_cfg(tmp_path, "total_budget=2048"))
    assert (engine["sink_tokens"], engine["budget"], engine["recent_tokens"]) == (64, 2048 - 64 - 512, 512)
    engine = resolve_engine(_cfg(tmp_path, "sparse_method=streamingllm", "total_budget=2048"))
    assert (engine["recent_tokens"], engine["budget"]) == (2048 - 64, 0)
    with pytest.raises(ValueError, match="not both"):
        resolve_engine(_cfg(tmp_path, "total_budget=2048", "budget_fraction=0.5"))
    with pytest.raises(ValueError, match=r"total_budget=100 is fewer than sink_tokens \+ recent_tokens"):
        resolve_engine(_cfg(tmp_path, "total_budget=100"))
    with pytest.raises(ValueError, match="positive number of tokens"):
        resolve_engine(_cfg(tmp_path, "total_budget=0"))
