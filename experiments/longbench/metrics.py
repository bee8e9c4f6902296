"""LongBench's metrics (after THUDM/LongBench ``metrics.py``), in plain Python."""

from __future__ import annotations

import re
import string
from collections import Counter
from difflib import SequenceMatcher


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _f1(pred_tokens: list[str], ref_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    p, r = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * p * r / (p + r)


def qa_f1_score(pred: str, ref: str, **_) -> float:
    return _f1(normalize_answer(pred).split(), normalize_answer(ref).split())


def _lcs(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_score(pred: str, ref: str, **_) -> float:
    a, b = pred.lower().split(), ref.lower().split()
    if not a or not b:
        return 0.0
    lcs = _lcs(a, b)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def classification_score(pred: str, ref: str, all_classes: list[str] | None = None, **_) -> float:
    matches = [c for c in (all_classes or []) if c in pred]
    matches = [m for m in matches if not (m in ref and m != ref)]
    return 1.0 / len(matches) if ref in matches else 0.0


def retrieval_score(pred: str, ref: str, **_) -> float:
    found = re.findall(r"Paragraph (\d+)", ref)
    if not found:
        return 0.0
    numbers = re.findall(r"\d+", pred)
    return sum(n == found[0] for n in numbers) / len(numbers) if numbers else 0.0


def count_score(pred: str, ref: str, **_) -> float:
    numbers = re.findall(r"\d+", pred)
    return sum(n == str(ref) for n in numbers) / len(numbers) if numbers else 0.0


def code_sim_score(pred: str, ref: str, **_) -> float:
    lines = [ln for ln in pred.lstrip("\n").split("\n") if not any(c in ln for c in ("`", "#", "//"))]
    first = lines[0] if lines else ""
    return SequenceMatcher(None, first, ref).ratio()


METRICS = {
    "narrativeqa": qa_f1_score, "qasper": qa_f1_score, "multifieldqa_en": qa_f1_score, "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score, "musique": qa_f1_score, "gov_report": rouge_l_score, "qmsum": rouge_l_score,
    "multi_news": rouge_l_score, "trec": classification_score, "triviaqa": qa_f1_score,
    "samsum": rouge_l_score, "passage_retrieval_en": retrieval_score, "passage_count": count_score,
    "lcc": code_sim_score, "repobench-p": code_sim_score,
}


def score(subtask: str, pred: str, answers: list[str], all_classes: list[str] | None = None) -> float:
    """Best score over the references, in [0, 1] (LongBench takes the max)."""
    if subtask not in METRICS:
        raise ValueError(f"Unknown LongBench subtask {subtask!r}. Valid: {', '.join(METRICS)}")
    if subtask in ("trec", "triviaqa", "samsum", "lsht"):
        pred = pred.lstrip("\n").split("\n")[0]
    fn = METRICS[subtask]
    return max((fn(pred, ref, all_classes=all_classes) for ref in answers), default=0.0)
