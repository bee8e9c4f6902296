"""Time to first token against prompt length, one line per lane (smallest measured batch)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.figures.style import colour, plt, require_rows, save


def render(tp: pd.DataFrame, out_dir: str | Path, name: str = "ttft_vs_context"):
    require_rows(tp, "throughput")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    lanes = sorted(tp["lane"].unique())
    for ln in lanes:
        rows = tp[tp["lane"] == ln]
        smallest = rows[rows["batch"] == rows["batch"].min()]
        pts = smallest.groupby("context_length")["ttft_s_mean"].mean().sort_index()
        ax.plot(pts.index, pts.values, marker="o", color=colour(ln, lanes),
                label=f"{ln} (bs={int(rows['batch'].min())})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(", ".join(sorted(tp["model"].unique())))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, save(fig, out_dir, name)
