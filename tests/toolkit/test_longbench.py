"""LongBench: local JSONL loading, a clear error naming the expected path, per-sub-task metrics."""

from __future__ import annotations

import json

import pytest

from experiments.longbench import data, metrics
from experiments.tasks.longbench import LongBenchTask


def test_missing_data_names_the_expected_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "hotpotqa.jsonl")):
        data.load_subtask("hotpotqa", tmp_path)
    with pytest.raises(ValueError, match="Valid"):
        data.load_subtask("nope", tmp_path)


def test_prompts_from_local_jsonl(tmp_path, smollm2_tokenizer) -> None:
    rows = [{"input": "Who?", "context": "Alice met Bob. " * 400, "answers": ["Alice"], "length": 1600,
             "all_classes": None}] * 3
    (tmp_path / "hotpotqa.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    task = LongBenchTask(context_length=512, num_samples=2, subtasks=["hotpotqa"], data_dir=str(tmp_path))
    prompts = task.prompts(smollm2_tokenizer)
    assert len(prompts) == 2 and all(len(p.ids) <= 512 - 32 + 40 for p in prompts)
    assert smollm2_tokenizer.decode(prompts[0].ids).rstrip().endswith("assistant")


def test_metrics_on_known_outputs() -> None:
    assert metrics.score("hotpotqa", "The Alice", ["alice"]) == 1.0
    assert metrics.score("hotpotqa", "Alice Smith", ["Alice"]) == pytest.approx(2 / 3)
    assert metrics.score("passage_retrieval_en", "Paragraph 3", ["Paragraph 3"]) == 1.0
    assert metrics.score("passage_count", "5", ["4"]) == 0.0
    assert metrics.score("trec", "Location", ["Location"], ["Location", "Number"]) == 1.0
    assert metrics.score("gov_report", "the cat sat", ["the cat sat"]) == 1.0
    assert metrics.score("lcc", "x = 1\n", ["x = 1"]) == 1.0
