"""Hydra callbacks: at the end of a sweep, print its records as a table and, when asked,
write the aggregated CSV and figures (a figure = one experiment + this one call). A sweep
whose ``records_path`` is set on the command line writes them beside its records
(``<records folder>/summary``), never over the experiment's ``results_dir``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

KEY_COLUMNS = ["task", "status", "model", "sparse_method", "prefill_sparse_method", "budget", "context_length",
               "budget_fraction"]


class SweepSummary(Callback):
    def __init__(self, records_path: str, results_dir: str | None = None, csv_name: str | None = None,
                 figures: list[str] | None = None, scope: str = "sweep") -> None:
        """``scope``: ``sweep`` summarises this sweep's records; ``records`` every record in
        ``records_path`` (an experiment whose lanes come from several commands)."""
        if scope not in ("sweep", "records"):
            raise ValueError(f"Invalid scope={scope!r}: 'sweep' or 'records'")
        self.records_path, self.results_dir, self.csv_name = records_path, results_dir, csv_name
        self.scope = scope
        self.figures = list(figures or [])

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from experiments import aggregate
        from experiments.figures import accuracy_vs_budget, decode_throughput, fidelity_vs_budget, ttft_vs_context

        if not Path(self.records_path).exists():
            print(f"no records at {self.records_path}")
            return
        sweep_dir = str(Path(config.hydra.sweep.dir).resolve())
        df = aggregate.load_records(self.records_path, status=None)
        if self.scope == "sweep":
            df = df[df["job_dir"].fillna("").str.startswith(sweep_dir)]
        if df.empty:
            return
        scores = [c for c in df.columns if c.endswith("/score") and c.count("/") == 1]
        cols = [c for c in KEY_COLUMNS + scores + ["decode/max_batch_output_tok_s"] if c in df.columns]
        print(df[cols].to_string(index=False))
        if self.results_dir is None:
            return
        ok = df[df["status"] == "ok"]
        out = Path(self.results_dir)
        if any(str(o).lstrip("+").startswith("records_path=") for o in config.hydra.overrides.task):
            # a sweep into its own records file must not overwrite the experiment's results
            out = Path(self.records_path).parent / "summary"
            print(f"records_path was set on the command line: the summary goes to {out}, not {self.results_dir}")
        acc, tp, fid = aggregate.accuracy_table(ok), aggregate.throughput_table(ok), aggregate.fidelity_table(ok)
        if self.csv_name:
            table = next((t for t in (acc, tp, fid) if not t.empty), acc)
            out.mkdir(parents=True, exist_ok=True)
            table.to_csv(out / self.csv_name, index=False)
            print(f"wrote {out / self.csv_name}")
        renderers = {"accuracy_vs_budget": (accuracy_vs_budget, acc), "decode_throughput": (decode_throughput, tp),
                     "ttft_vs_context": (ttft_vs_context, tp), "fidelity_vs_budget": (fidelity_vs_budget, fid)}
        for entry in self.figures:  # "figure" or "figure:file stem"
            name, _, stem = entry.partition(":")
            if name not in renderers:
                raise ValueError(f"Unknown figure {name!r}. Valid: {', '.join(renderers)}")
            module, table = renderers[name]
            if not table.empty:
                print("wrote", *module.render(table, out / "figures", stem or name)[1])
