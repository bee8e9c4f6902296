"""Fidelity against total budget (fraction of the context): one panel per decode-path
measure (``experiments/tasks/fidelity.py``), one line per method and context length."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.figures.style import REFERENCE, budget_axis, plt, require_rows, save, shared_legend

MARKERS = "osD^v<>p"
# (column, axis label, log scale): lower is closer to the reference, except top-1
PANELS = (("decode_kl_mean", "decode KL(ref || method)", True),
          ("attention_output_rel_error", "attention output rel. error", True),
          ("decode_teacher_forced_top1", "decode top-1 agreement", False))


def render(fid: pd.DataFrame, out_dir: str | Path, name: str = "fidelity_vs_budget"):
    require_rows(fid, "fidelity")
    fid = fid[fid["sparse_method"] != REFERENCE].copy()
    require_rows(fid, "non-reference fidelity")
    fid["fraction"] = fid["total_budget"] / fid["context_length"]  # what the method held
    contexts = sorted(fid["context_length"].unique())
    methods = sorted(fid["sparse_method"].unique())
    fig, axes = plt.subplots(1, len(PANELS), figsize=(3.6 * len(PANELS), 3.0), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, (col, label, log) in zip(axes[0], PANELS):
        for ci, ctx in enumerate(contexts):
            for mi, method in enumerate(methods):
                pts = fid[(fid["sparse_method"] == method) & (fid["context_length"] == ctx)]
                pts = pts.dropna(subset=[col]).groupby("fraction")[col].mean()
                if len(pts):
                    ax.plot(pts.index, pts.values, marker=MARKERS[ci % len(MARKERS)], color=cmap(mi % 10),
                            label=f"{method} {int(ctx)}")
        budget_axis(ax, fid["fraction"].min())
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(-0.05, 1.05)
        ax.set_title(label, fontsize=9)
    shared_legend(fig, axes.flat)
    return fig, save(fig, out_dir, name)
