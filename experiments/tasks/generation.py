"""Shared by the generation tasks: run prompts through the engine in chunks, score each
output, write one sample line per prompt, and log running metrics after every chunk."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tqdm.auto import tqdm

from experiments.tasks.base import TaskEnv


@dataclass(frozen=True)
class Prompt:
    subtask: str
    index: int
    ids: list[int]
    answers: list[str]
    max_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


Scorer = Callable[[Prompt, Any], float]  # (prompt, RequestOutput) -> score in [0, 1]


def run_prompts(llm, prompts: list[Prompt], score: Scorer, env: TaskEnv, prefix: str,
                chunk_size: int = 8) -> list[dict[str, Any]]:
    from sparseengine import SamplingParams

    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    bar = tqdm(total=len(prompts), desc=prefix, unit="prompt")
    try:
        for i in range(0, len(prompts), chunk_size):
            chunk = prompts[i:i + chunk_size]
            params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens) for p in chunk]
            outputs = llm.generate([p.ids for p in chunk], params)
            for p, out in zip(chunk, outputs):
                s = score(p, out) if out.finish_reason != "error" else 0.0
                row = {"subtask": p.subtask, "index": p.index, "score": s, "answers": p.answers,
                       "output": out.text or " ".join(map(str, out.token_ids)), "finish_reason": out.finish_reason,
                       "error": out.error, **{f"m_{k}": v for k, v in out.metrics.items()}, **p.meta}
                rows.append(row)
                env.sample(row)
            bar.update(len(chunk))
            env.log(summarize(rows, prefix, time.perf_counter() - start))
    finally:
        bar.close()
    return rows


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarize(rows: list[dict[str, Any]], prefix: str, wall_s: float | None = None) -> dict[str, Any]:
    """``<prefix>/<subtask>/score`` (percent), ``<prefix>/score`` (mean over subtasks), and
    generation statistics under ``gen/``."""
    out: dict[str, Any] = {}
    subtasks = sorted({r["subtask"] for r in rows})
    per = {}
    for sub in subtasks:
        mine = [r for r in rows if r["subtask"] == sub]
        per[sub] = 100.0 * statistics.fmean(r["score"] for r in mine)
        if len(subtasks) > 1 or sub != prefix:
            out[f"{prefix}/{sub}/score"] = per[sub]
            out[f"{prefix}/{sub}/num_samples"] = len(mine)
    out[f"{prefix}/score"] = statistics.fmean(per.values()) if per else None
    out[f"{prefix}/num_samples"] = len(rows)
    out["gen/prompt_tokens_mean"] = _mean([r.get("m_prompt_tokens") for r in rows])
    out["gen/output_tokens_mean"] = _mean([r.get("m_output_tokens") for r in rows])
    out["gen/ttft_s_mean"] = _mean([r.get("m_ttft_s") for r in rows])
    out["gen/kv_tokens_mean"] = _mean([r.get("m_kv_tokens") for r in rows])
    out["gen/preemptions"] = sum(r.get("m_preemptions") or 0 for r in rows)
    out["gen/errors"] = sum(r["finish_reason"] == "error" for r in rows)
    if wall_s is not None:
        out["gen/wall_s"] = wall_s
    return out
