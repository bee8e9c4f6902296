"""Figures (matplotlib, PNG + PDF) drawn from records."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def render_all(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Every figure the records support; returns the files written."""
    from experiments import aggregate
    from experiments.figures import accuracy_vs_budget, decode_throughput, fidelity_vs_budget, ttft_vs_context

    written: list[Path] = []
    acc, tp, fid = aggregate.accuracy_table(df), aggregate.throughput_table(df), aggregate.fidelity_table(df)
    if not tp.empty:
        written += decode_throughput.render(tp, out_dir)[1]
        written += ttft_vs_context.render(tp, out_dir)[1]
    if not acc.empty:
        written += accuracy_vs_budget.render(acc, out_dir)[1]
    if not fid.empty:
        written += fidelity_vs_budget.render(fid, out_dir)[1]
    return written
