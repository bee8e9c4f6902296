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
                   f"task.reference_cache_dir={tmp_path / 'cache'}", f"records_path={tmp_path / 'r.jsonl'}"])
    run_job(cfg)
    (rec,) = read_records(tmp_path / "r.jsonl")
    m = rec["metrics"]
    assert rec["status"] == "ok" and m["fidelity/num_samples"] == 2 and m["fidelity/decode_preemptions"] == 0
    assert all(isinstance(m[k], float) for k in DECODE_METRICS), {k: m.get(k) for k in DECODE_METRICS}
    assert m["fidelity/attention_output_rel_error"] > 0.01 and m["fidelity/decode_kl_mean"] > 1e-4
    assert m["fidelity/decode_kl_max"] >= m["fidelity/decode_kl_mean"]
    assert 0 <= m["fidelity/decode_teacher_forced_top1"] <= 1
    assert m["fidelity/kl_mean"] < 1e-4  # the prompt path: a dense prefill, blind to StreamingLLM
    assert m["fidelity/reference_cached"] is False and len(list((tmp_path / "cache").glob("*.pt"))) == 1


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


def _run(tmp_path, engine_overrides: list[str], cache, name: str) -> dict:
    cfg = compose(["debug=tiny", *engine_overrides])
    env = TaskEnv(engine_kwargs=dict(cfg.engine), seed=0, job_dir=tmp_path / name, log=lambda m: None)
    return FidelityTask(context_length=64, num_samples=2, max_tokens=5, kl_positions=8,
                        reference_cache_dir=cache).run(env)


def test_reference_cache_is_shared_across_budgets_and_equals_a_fresh_pass(tmp_path) -> None:
    """A sweep's second job (another budget, another method) takes the reference from the cache,
    and its metrics equal those of a job that computed the reference itself; a reference engine
    that differs (its dtype) misses."""
    cache = tmp_path / "cache"
    quest = ["sparse_method=quest", "engine.sink_tokens=4", "engine.recent_tokens=16"]
    first = _run(tmp_path, [*quest, "engine.budget=16"], cache, "a")
    assert first["fidelity/reference_cached"] is False
    stream = _run(tmp_path, ["sparse_method=streamingllm", "engine.sink_tokens=4", "engine.recent_tokens=24"], cache,
                "b")
    again = _run(tmp_path, [*quest, "engine.budget=16"], cache, "c")
    fresh = _run(tmp_path, [*quest, "engine.budget=16"], None, "d")
    assert stream["fidelity/reference_cached"] is True and again["fidelity/reference_cached"] is True
    assert fresh["fidelity/reference_cached"] is False
    assert {k: v for k, v in again.items() if k != "fidelity/reference_cached"} == {
        k: v for k, v in fresh.items() if k != "fidelity/reference_cached"}
    assert len(list(cache.glob("*.pt"))) == 1
    other = _run(tmp_path, [*quest, "engine.budget=16", "engine.dtype=bfloat16"], cache, "e")
    assert other["fidelity/reference_cached"] is False and len(list(cache.glob("*.pt"))) == 2


def test_reference_key_ignores_method_fields_only(tmp_path) -> None:
    """The key leaves out what only a sparse method reads and keeps everything else, the
    prompts, the model's files and the engine's source (an edit to a file under a hashed
    root changes it)."""
    from experiments.tasks import reference_cache as rc
    from sparseengine import Config

    base = Config.from_kwargs(model="tiny-llama").to_dict()
    task = {"context_length": 64}
    key = rc.reference_key(base, task, [[1, 2, 3]], "cpu")
    for same in ({"budget": 7}, {"sink_tokens": 1}, {"recent_tokens": 9}, {"method_knobs": {"quest_page_size": 8}}):
        assert rc.reference_key({**base, **same}, task, [[1, 2, 3]], "cpu") == key, same
    for other in ({"dtype": "bfloat16"}, {"prefill_chunk_size": 64}, {"seed": 1}):
        assert rc.reference_key({**base, **other}, task, [[1, 2, 3]], "cpu") != key, other
    assert rc.reference_key(base, {"context_length": 65}, [[1, 2, 3]], "cpu") != key
    assert rc.reference_key(base, task, [[1, 2, 4]], "cpu") != key
    weights = tmp_path / "model"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"1234")
    with_file = rc.reference_key(base, task, [[1, 2, 3]], "cpu", rc.weights_identity(weights))
    assert with_file != key and rc.weights_identity(None) == []
    (weights / "model.safetensors").write_bytes(b"12345")  # another file under the same model name
    assert rc.reference_key(base, task, [[1, 2, 3]], "cpu", rc.weights_identity(weights)) != with_file
    root = tmp_path / "src"
    root.mkdir()
    (root / "a.py").write_text("x = 1\n")
    before = rc.source_digest((root,))
    rc._digest.cache_clear()
    (root / "a.py").write_text("x = 2\n")
    assert rc.source_digest((root,)) != before
    rc._digest.cache_clear()
