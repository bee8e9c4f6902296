"""The fidelity task end to end on the tiny model: a decode-side method (StreamingLLM, its
total budget well below the prompt) departs from vanilla on the decode path, which the
prompt-path KL cannot see; vanilla against itself is exact, and each sample's record
carries the per-layer attention errors."""

from __future__ import annotations

import json

from experiments.job import run_job
from experiments.records import read_records
from experiments.tasks.base import TaskEnv
from experiments.tasks.fidelity import FidelityTask
from sparseengine.models.loader import SHAPES_DIR
from tests.toolkit.conftest import compose

DECODE_METRICS = ["fidelity/decode_kl_mean", "fidelity/decode_kl_max", "fidelity/decode_teacher_forced_top1",
                  "fidelity/attention_output_rel_error"]


def test_decode_side_method_is_measured_on_the_decode_path(tmp_path) -> None:
    cfg = compose(["debug=tiny", "task=fidelity", "task.max_tokens=8", "task.kl_positions=16",
                   "sparse_method=streamingllm", "engine.sink_tokens=4", "engine.recent_tokens=28",
                   f"records_path={tmp_path / 'r.jsonl'}"])
    run_job(cfg)
    (rec,) = read_records(tmp_path / "r.jsonl")
    m = rec["metrics"]
    assert rec["status"] == "ok" and m["fidelity/num_samples"] == 2 and m["fidelity/decode_preemptions"] == 0
    assert all(isinstance(m[k], float) for k in DECODE_METRICS), {k: m.get(k) for k in DECODE_METRICS}
    assert m["fidelity/attention_output_rel_error"] > 0.01 and m["fidelity/decode_kl_mean"] > 1e-4
    assert m["fidelity/decode_kl_max"] >= m["fidelity/decode_kl_mean"]
    assert 0 <= m["fidelity/decode_teacher_forced_top1"] <= 1
    assert m["fidelity/kl_mean"] < 1e-4  # the prompt path: a dense prefill, blind to StreamingLLM


def test_vanilla_against_itself_is_exact(tmp_path) -> None:
    cfg = compose(["debug=tiny"])
    logged = {}
    env = TaskEnv(engine_kwargs=dict(cfg.engine), seed=0, job_dir=tmp_path, log=logged.update)
    task = FidelityTask(context_length=64, num_samples=2, max_tokens=5, kl_positions=8)
    metrics = task.run(env)
    assert logged["fidelity/attention_output_rel_error"] == metrics["fidelity/attention_output_rel_error"]
    assert metrics["fidelity/attention_output_rel_error"] < 1e-6 and abs(metrics["fidelity/decode_kl_mean"]) < 1e-6
    assert metrics["fidelity/decode_teacher_forced_top1"] == 1.0 and metrics["fidelity/top1_agreement"] == 1.0
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1]
    layers = json.loads((SHAPES_DIR / "tiny-llama.json").read_text())["num_hidden_layers"]
    assert all(len(r["attention_output_rel_error_per_layer"]) == layers for r in rows)
    assert all(r["attention_output_rel_error_max"] < 1e-6 and r["decode_kl_worst_row"] < 1e-6 for r in rows)
