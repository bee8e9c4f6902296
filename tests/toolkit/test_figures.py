"""Figures are drawn from records: files exist, panels and lanes are the expected ones."""

from __future__ import annotations

import json

from experiments import aggregate
from experiments.figures import accuracy_vs_budget, decode_throughput, fidelity_vs_budget, ttft_vs_context

ENGINE = {"model": "llama-3.1-8b", "prefill_sparse_method": "none", "sink_tokens": 64, "recent_tokens": 512,
          "budget": 1472, "seed": 0}


def _record(task, engine, task_config, metrics, budget_fraction=None):
    return {"task": task, "status": "ok", "engine": {**ENGINE, **engine}, "task_config": task_config,
            "run": {"budget_fraction": budget_fraction, "choices": {}}, "metrics": metrics,
            "provenance": {"device_name": "test"}, "job_dir": None}


def _throughput(method, batches):
    metrics = {"decode/max_batch": max(batches)}
    for b, tok in batches.items():
        metrics.update({f"decode/bs{b}/output_tok_s": tok, f"decode/bs{b}/ttft_s_mean": 0.5,
                        f"decode/bs{b}/pct_of_limit": 50.0})
    return _record("throughput", {"sparse_method": method}, {"context_length": 131072}, metrics)


def test_two_panel_decode_figure_from_records(tmp_path) -> None:
    recs = [_throughput("vanilla", {1: 13.0, 6: 60.0}), _throughput("lane_x", {1: 20.0, 6: 150.0, 200: 2000.0})]
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    tp = aggregate.throughput_table(aggregate.load_records(path))
    fig, files = decode_throughput.render(tp, tmp_path / "figures")
    assert all(f.exists() and f.stat().st_size > 0 for f in files)
    assert {f.suffix for f in files} == {".png", ".pdf"}
    top, bottom = fig.axes
    lanes = [t.get_text() for t in bottom.get_xticklabels()]
    assert lanes == ["vanilla", "lane_x (total 2048)"]
    assert [round(p.get_height()) for p in top.patches] == [60, 2000]  # each lane's largest batch
    assert [round(p.get_height()) for p in bottom.patches] == [0, 150]  # +150 % at batch 6
    assert "batch 6" in bottom.get_ylabel()
    _, files = ttft_vs_context.render(tp, tmp_path / "figures")
    assert files[0].exists()


def test_decode_figure_without_a_vanilla_lane(tmp_path) -> None:
    """A sweep of sparse lanes alone (no vanilla in its records) still draws the top panel;
    the bottom one says there is nothing to compare with."""
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(_throughput("lane_x", {6: 150.0})))
    tp = aggregate.throughput_table(aggregate.load_records(path))
    assert aggregate.improvement_over_vanilla(tp).empty
    fig, files = decode_throughput.render(tp, tmp_path / "figures")
    top, bottom = fig.axes
    assert all(f.exists() for f in files) and [round(p.get_height()) for p in top.patches] == [150]
    assert "no vanilla lane" in bottom.get_ylabel() and [t.get_text() for t in bottom.texts] == ["n/a"]


def test_accuracy_figure_from_records(tmp_path) -> None:
    recs = [_record("ruler", {"sparse_method": "vanilla", "budget": 0}, {"context_length": 2048},
                    {"ruler/score": 80.0, "ruler/vt/score": 70.0, "ruler/cwe/score": 90.0}, 0.5)]
    for frac, s in ((0.125, 20.0), (0.25, 40.0), (0.5, 60.0)):
        recs.append(_record("ruler", {"sparse_method": "lane_x", "sink_tokens": 0, "recent_tokens": 0,
                                      "budget": int(2048 * frac)}, {"context_length": 2048},
                            {"ruler/score": s, "ruler/vt/score": s, "ruler/cwe/score": s}, frac))
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    acc = aggregate.accuracy_table(aggregate.load_records(path))
    assert set(acc["task"]) == {"ruler", "ruler/vt", "ruler/cwe"}
    fig, files = accuracy_vs_budget.render(acc, tmp_path / "figures")
    assert files[0].exists()
    titles = [a.get_title() for a in fig.axes if a.get_title()]
    assert sorted(titles) == ["ruler", "ruler/cwe", "ruler/vt"]
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert labels == ["vanilla 2048", "lane_x 2048"]


def _fidelity(method, frac, kl, err, top1, end):
    engine = {"sparse_method": method, "sink_tokens": 16, "recent_tokens": 64, "budget": int(2048 * frac) - 80}
    metrics = {"fidelity/decode_kl_mean": kl, "fidelity/attention_output_rel_error": err,
               "fidelity/decode_teacher_forced_top1": top1, "fidelity/reference_method": "vanilla",
               "fidelity/num_samples": 4}
    return {**_record("fidelity", engine, {"context_length": 2048}, metrics, frac), "end_time": end}


def test_fidelity_table_and_figure_from_records(tmp_path) -> None:
    """One row per (method, budget) with the metrics unprefixed, a rerun cell keeping its
    latest record; the figure draws one panel per decode-path measure, a line per method."""
    recs = [_fidelity("lane_x", 0.125, 0.5, 0.4, 0.7, "t1"), _fidelity("lane_x", 0.25, 0.2, 0.2, 0.8, "t2"),
            _fidelity("lane_y", 0.25, 0.1, 0.1, 0.9, "t3"), _fidelity("lane_x", 0.125, 0.3, 0.3, 0.75, "t4")]
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs))
    fid = aggregate.fidelity_table(aggregate.load_records(path))
    assert list(zip(fid["sparse_method"], fid["total_budget"], fid["decode_kl_mean"])) == [
        ("lane_x", 256, 0.3), ("lane_x", 512, 0.2), ("lane_y", 512, 0.1)]  # t4 replaced t1
    assert list(fid["budget_fraction"]) == [0.125, 0.25, 0.25] and set(fid["reference_method"]) == {"vanilla"}
    fig, files = fidelity_vs_budget.render(fid, tmp_path / "figures")
    assert all(f.exists() and f.stat().st_size > 0 for f in files)
    assert [a.get_title() for a in fig.axes] == ["decode KL(ref || method)", "attention output rel. error",
                                                 "decode top-1 agreement"]
    kl = fig.axes[0]
    assert [line.get_label() for line in kl.get_lines()] == ["lane_x 2048", "lane_y 2048"]
    assert list(kl.get_lines()[0].get_ydata()) == [0.3, 0.2]
    assert aggregate.throughput_table(aggregate.load_records(path)).empty


def test_sweep_summary_never_overwrites_results_from_a_redirected_sweep(tmp_path) -> None:
    """An experiment's summary writes its CSV and figure into ``results_dir``; a sweep whose
    ``records_path`` was set on the command line writes them beside its records instead."""
    from omegaconf import OmegaConf

    from experiments.callbacks import SweepSummary

    path = tmp_path / "runs" / "records.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps(_throughput("vanilla", {1: 13.0, 6: 60.0})) + "\n")
    results = tmp_path / "results"

    def summarise(overrides):
        summary = SweepSummary(str(path), results_dir=str(results), csv_name="t.csv",
                               figures=["decode_throughput:t"], scope="records")
        summary.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)},
                                                            "overrides": {"task": overrides}}}))

    summarise(["sparse_method=vanilla"])
    assert (results / "t.csv").exists() and (results / "figures" / "t.png").exists()
    stamps = {p: p.stat().st_mtime_ns for p in (results / "t.csv", results / "figures" / "t.png")}
    summarise(["sparse_method=vanilla", f"records_path={path}"])
    redirected = path.parent / "summary"
    assert (redirected / "t.csv").exists() and (redirected / "figures" / "t.png").exists()
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # the results were not written again
