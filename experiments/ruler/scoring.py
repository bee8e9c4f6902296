"""RULER's metrics: every reference must appear in the prediction (``all``), or any (``part``)."""

from __future__ import annotations

from typing import Sequence


def _part_all(pred: str, refs: Sequence[str]) -> float:
    p = pred.lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the fraction of references found in the prediction (0..1)."""
    if not preds:
        return float("nan")
    return sum(_part_all(p, r) for p, r in zip(preds, refs)) / len(preds)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of 1 if any reference is found in the prediction (0..1)."""
    if not preds:
        return float("nan")
    return sum(max(r.lower() in p.lower() for r in ref) for p, ref in zip(preds, refs)) / len(preds)


METRIC_OF_TASK = {"niah_single": "all", "niah_multikey": "all", "niah_multivalue": "all", "vt": "all",
                  "cwe": "all", "fwe": "all", "passkey": "all"}


def score_sample(task: str, pred: str, refs: Sequence[str]) -> float:
    """One sample's score in [0, 1] under the task's RULER metric."""
    metric = METRIC_OF_TASK.get(task)
    if metric is None:
        raise ValueError(f"Unknown RULER task {task!r}. Valid: {', '.join(METRIC_OF_TASK)}")
    return string_match_all([pred], [refs]) if metric == "all" else string_match_part([pred], [refs])
