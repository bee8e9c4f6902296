"""run.py end to end in a subprocess: a multirun writes one record per job with the right
fields; a job made to fail is recorded as failed and the others finish."""

from __future__ import annotations

from sparseengine import Config
from experiments.records import read_records
from tests.toolkit.conftest import CONF, run_py

from sparseengine.method_registry import decode_methods

# vanilla plus up to two registered methods that run on any model without extra knobs.
METHODS = ",".join(["vanilla"] + [m for m in ("streamingllm", "snapkv")
                                  if m in decode_methods() and (CONF / "sparse_method" / f"{m}.yaml").exists()])


def test_multirun_writes_one_record_per_job(tmp_path) -> None:
    records = tmp_path / "records.jsonl"
    proc = run_py(["-m", "debug=tiny", "task=passkey", f"sparse_method={METHODS}", "engine.budget=64,128",
                   f"records_path={records}", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(read_records(records))
    assert len(rows) == 2 * len(METHODS.split(","))
    assert {(r["engine"]["sparse_method"], r["engine"]["budget"]) for r in rows} == {
        (m, b) for m in METHODS.split(",") for b in (64, 128)}
    for r in rows:
        assert r["status"] == "ok", r["error"]
        assert set(Config.field_names()) <= set(r["engine"]), "the full resolved Config, same names"
        assert r["engine"]["model"] == "tiny-llama"
        assert r["task_config"]["context_length"] == 256
        assert 0 <= r["metrics"]["passkey/score"] <= 100
        assert r["metrics"]["passkey/num_samples"] == 2
        assert all("/" in k for k in r["metrics"])
        assert r["metrics"]["attention/provider"] == "torch"  # which implementation ran each op
        assert r["metrics"]["attention/ops/decode"] == r["metrics"]["attention/ops/prefill"] == "torch"
        assert r["metrics"]["engine/async_scheduling"] is False  # the config's None, resolved on the CPU
        for key in ("git_commit", "git_dirty", "device", "packages"):
            assert key in r["provenance"]
        assert r["start_time"] <= r["end_time"]
        assert (tmp_path / "sweep").as_posix() in r["job_dir"]


def test_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path) -> None:
    records = tmp_path / "records.jsonl"
    proc = run_py(["-m", "debug=tiny", "task=passkey", "engine.budget=64,-1,128", f"records_path={records}",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(read_records(records))
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    assert "budget=-1" in rows[1]["error"]
    assert rows[1]["engine"]["budget"] == -1  # the config as given is kept
    assert (tmp_path / "sweep" / "1" / "traceback.txt").exists()


def test_sigterm_records_the_running_job_as_interrupted(tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.toolkit.conftest import ROOT

    records = tmp_path / "records.jsonl"
    proc = subprocess.Popen([sys.executable, "run.py", "debug=tiny", "task=throughput", "task.output_len=3800",
                             "task.timed_steps=3700",  # a window long enough to be interrupted
                             "task.batch_sizes=[1]", "+engine.num_kv_pages=400",
                             f"records_path={records}", f"hydra.run.dir={tmp_path / 'run'}"],
                            cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record_json = tmp_path / "run" / "record.json"

    def written() -> str:
        return record_json.read_text() if record_json.exists() else ""

    deadline = time.time() + 120
    while time.time() < deadline and "decode/max_batch" not in written():
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    (rec,) = read_records(records)
    assert rec["status"] == "interrupted"
    assert rec["metrics"]["decode/max_batch"] >= 1  # measured before the signal, kept


def test_resume_runs_only_the_jobs_not_yet_recorded_ok(tmp_path) -> None:
    records = tmp_path / "records.jsonl"
    first = run_py(["-m", "debug=tiny", "task=passkey", "engine.budget=64,-1", f"records_path={records}",
                    f"hydra.sweep.dir={tmp_path / 'sweep1'}"])
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_py(["-m", "debug=tiny", "task=passkey", "engine.budget=64,-1,128", "resume=true",
                    f"records_path={records}", f"hydra.sweep.dir={tmp_path / 'sweep2'}"])
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [(r["engine"]["budget"], r["status"], "sweep2" in r["job_dir"]) for r in read_records(records)]
    # budget=64 was ok: not run again; the failed job and the new one run in the second sweep
    assert rows == [(64, "ok", False), (-1, "failed", False), (-1, "failed", True), (128, "ok", True)]
    assert "resume: already recorded (ok" in again.stdout
