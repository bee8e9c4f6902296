"""Accuracy against total budget (fraction of the context), one panel per task; the dense
reference drawn as a horizontal line per context length."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from experiments.figures.style import REFERENCE, budget_axis, plt, require_rows, save, shared_legend

MARKERS = "osD^v<>p"


def render(acc: pd.DataFrame, out_dir: str | Path, name: str = "accuracy_vs_budget"):
    require_rows(acc, "scored (passkey/ruler/longbench)")
    acc = acc.copy()
    acc["fraction"] = acc["total_budget"] / acc["context_length"]  # what the method held
    tasks = sorted(acc["task"].unique(), key=lambda t: (t.count("/") == 0 and t != "passkey", t))
    contexts = sorted(acc["context_length"].unique())
    methods = sorted(m for m in acc["sparse_method"].unique() if m != REFERENCE)
    cols = min(4, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.8 * rows), squeeze=False, sharey=True)
    cmap = plt.get_cmap("tab10")
    for ax, task in zip(axes.flat, tasks):
        t = acc[acc["task"] == task]
        for ci, ctx in enumerate(contexts):
            ref = t[(t["sparse_method"] == REFERENCE) & (t["context_length"] == ctx)]
            if len(ref):
                ax.axhline(ref["score"].mean(), color="0.3", ls=["--", ":", "-."][ci % 3], lw=1,
                           label=f"{REFERENCE} {int(ctx)}")
            for mi, method in enumerate(methods):
                lane = t[(t["sparse_method"] == method) & (t["context_length"] == ctx)]
                pts = lane.groupby("fraction")["score"].mean()
                if len(pts):
                    ax.plot(pts.index, pts.values, marker=MARKERS[ci % len(MARKERS)], color=cmap(mi % 10),
                            label=f"{method} {int(ctx)}")
        ax.set_title(task, fontsize=9)
        budget_axis(ax, acc["fraction"].min())
        ax.set_ylim(-5, 105)
    for ax in axes.flat[len(tasks):]:
        ax.axis("off")
    axes[0][0].set_ylabel("score (%)")
    shared_legend(fig, axes.flat)
    return fig, save(fig, out_dir, name)
