"""One Hydra job: resolve the engine config, run the task, record it whatever happens.

The record is appended when the job ends, ``ok``, ``failed`` (the error is kept and the
sweep goes on) or ``interrupted`` (Ctrl-C or SIGTERM: what was measured is written, then
the interrupt propagates). Loggers are always finished in ``finally``.
"""

from __future__ import annotations

import signal
import threading
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from experiments import deltakv_checkpoint, provenance
from experiments.loggers.base import Logger
from experiments.records import Record, read_records
from experiments.tasks.base import TaskEnv


def resolve_engine(cfg: DictConfig) -> dict[str, Any]:
    """``cfg.engine`` as LLM keywords, with ``budget_fraction`` (of the context) or
    ``total_budget`` (tokens) turned into the total budget through the method's
    ``budget_knob``: ``budget`` = total - sink - recent, or, for a method that leaves
    ``budget`` unused (StreamingLLM), ``recent_tokens`` = total - sink (``split_total``)."""
    from sparseengine.method_registry import split_total

    engine: dict[str, Any] = OmegaConf.to_container(cfg.engine, resolve=True)  # type: ignore[assignment]
    frac, total = cfg.get("budget_fraction"), cfg.get("total_budget")
    if frac is not None and total is not None:
        raise ValueError(f"set budget_fraction ({frac}) or total_budget ({total}), not both")
    if frac is not None:
        if not 0 < float(frac) <= 1:
            raise ValueError(f"budget_fraction={frac!r}: must be in (0, 1]")
        total = round(float(frac) * int(cfg.task.context_length))
        what = f"budget_fraction={frac} gives {total} total tokens at context_length={cfg.task.context_length},"
    elif total is not None:
        if int(total) != total or int(total) < 1:
            raise ValueError(f"total_budget={total!r}: must be a positive number of tokens")
        total, what = int(total), f"total_budget={total} is"
    else:
        return engine
    sink, recent = int(engine.get("sink_tokens", 64)), int(engine.get("recent_tokens", 512))
    engine.update(split_total(engine.get("sparse_method", "vanilla"), total, sink, recent, what))
    return engine


def _skip_reason(cfg: DictConfig, engine: dict[str, Any]) -> str | None:
    from sparseengine.method_registry import get_spec

    dense_at = cfg.get("dense_budget_fraction")
    if dense_at is None or cfg.get("budget_fraction") is None:
        return None
    spec = get_spec(engine.get("sparse_method", "vanilla"))
    if spec.family == "dense" and float(cfg.budget_fraction) != float(dense_at):
        return (f"sparse_method={spec.name!r} is dense (registry family 'dense'): the budget has no effect; "
                f"it is measured once, at budget_fraction={dense_at}")
    return None


def _job_info(cfg: DictConfig) -> dict[str, Any]:
    try:
        hc = HydraConfig.get()
    except ValueError:  # called outside @hydra.main (tests, notebooks)
        return {"job_dir": None, "mode": "RUN", "overrides": [], "choices": {}, "job_num": 0}
    return {"job_dir": hc.runtime.output_dir, "mode": hc.mode.name, "job_num": hc.job.get("num", 0),
            "overrides": list(hc.overrides.task),
            "choices": {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}}


def _sigterm_as_interrupt() -> None:
    """A plain ``kill`` or a scheduler's time limit then records the job as interrupted too.
    Left alone when someone (e.g. submitit) already handles SIGTERM."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        def handler(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        signal.signal(signal.SIGTERM, handler)


def _recorded_before(cfg: DictConfig, info: dict[str, Any]) -> dict[str, Any] | None:
    """With ``resume=true``: the last ``ok`` (or ``skipped``) record in ``records_path`` of a
    job with this task and these overrides (``resume=`` itself aside), if there is one."""
    path = cfg.get("records_path")
    if not cfg.get("resume") or not path or not Path(path).exists():
        return None
    mine = sorted(o for o in info["overrides"] if not o.startswith("resume="))
    found = None
    for rec in read_records(path):
        run = rec.get("run") or {}
        theirs = sorted(o for o in run.get("overrides") or [] if not o.startswith("resume="))
        if rec.get("status") in ("ok", "skipped") and rec.get("task") == cfg.task.get("name") and theirs == mine:
            found = rec
    return found


def run_job(cfg: DictConfig) -> float | None:
    _sigterm_as_interrupt()
    info = _job_info(cfg)
    done = _recorded_before(cfg, info)
    if done is not None:
        print(f"resume: already recorded ({done['status']}, ended {done.get('end_time')}): "
              f"{' '.join(info['overrides']) or '(no overrides)'}")
        score = done.get("metrics", {}).get(f"{done['task']}/score")
        return float(score) if isinstance(score, (int, float)) else None
    raw_engine = OmegaConf.to_container(cfg.engine, resolve=True)
    record = Record(task=str(cfg.task.get("name", "?")), engine=dict(raw_engine),  # type: ignore[arg-type]
                    task_config={k: v for k, v in OmegaConf.to_container(cfg.task, resolve=True).items()
                                 if k != "_target_"},  # type: ignore[union-attr]
                    run={"seed": cfg.seed, "budget_fraction": cfg.get("budget_fraction"),
                         "choices": info["choices"], "overrides": info["overrides"], "job_num": info["job_num"]},
                    provenance=provenance.collect(), start_time=provenance.now_iso(), job_dir=info["job_dir"])
    loggers: list[Logger] = []
    try:
        for logger_cfg in cfg.logger.values():  # one by one: those made before a failure still finish
            loggers.append(instantiate(logger_cfg))
            loggers[-1].start(record)
        engine = resolve_engine(cfg)
        if deltakv_checkpoint.wanted(engine):  # deltakv_checkpoint=auto: the cached fit (made first if missing)
            engine = deltakv_checkpoint.resolve(engine, cfg.deltakv_cache_dir, cfg.deltakv_auto_tokens)
        from sparseengine import Config

        record.engine = Config.from_kwargs(**engine).to_dict()
        skip = _skip_reason(cfg, engine)
        if skip:
            record.status, record.error = "skipped", skip
            return None

        def log(metrics: dict[str, Any]) -> None:
            record.metrics.update(metrics)
            for lg in loggers:
                lg.log_metrics(metrics, record)

        def table(name: str, rows: list[dict[str, Any]]) -> None:
            for lg in loggers:
                lg.log_table(name, rows)

        task = instantiate(cfg.task, _convert_="all")
        env = TaskEnv(engine_kwargs=engine, seed=int(cfg.seed), log=log, table=table,
                      job_dir=Path(info["job_dir"]) if info["job_dir"] else None)
        log(task.run(env) or {})
        record.status = "ok"
    except KeyboardInterrupt:
        record.status, record.error = "interrupted", "KeyboardInterrupt (Ctrl-C or SIGTERM)"
        raise
    except Exception as exc:  # recorded; the sweep goes on
        record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"
        if info["job_dir"]:
            (Path(info["job_dir"]) / "traceback.txt").write_text(traceback.format_exc())
        traceback.print_exc()
    finally:
        record.end_time = provenance.now_iso()
        for lg in loggers:
            try:
                lg.finish(record)
            except Exception:  # one broken logger must not lose the others' records
                traceback.print_exc()
        if cfg.get("print_table", True):
            print(format_table(record))
    if record.status == "failed" and info["mode"] == RunMode.RUN.name:
        raise SystemExit(1)
    score = record.metrics.get(f"{record.task}/score")
    return float(score) if isinstance(score, (int, float)) else None


def format_table(record: Record) -> str:
    e = record.engine
    head = (f"[{record.status}] task={record.task} model={e.get('model')} sparse_method={e.get('sparse_method')} "
            f"prefill_sparse_method={e.get('prefill_sparse_method')} budget={e.get('budget')}")
    lines = [head] + ([f"  error: {record.error}"] if record.error else [])
    width = max((len(k) for k in record.metrics), default=0)
    for key, value in record.metrics.items():
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"  {key:<{width}}  {text}")
    return "\n".join(lines)
