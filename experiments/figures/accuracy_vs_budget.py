"""Accuracy against total budget (fraction of the context), one panel per task; the dense
reference drawn as a horizontal line per context length."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from experiments.figures.style import REFERENCE, plt, require_rows, save

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
                pts = t[(t["sparse_method"] == method) & (t["context_length"] == ctx)].groupby("fraction")["score"].mean()
                if len(pts):
                    ax.plot(pts.index, pts.values, marker=MARKERS[ci % len(MARKERS)], color=cmap(mi % 10),
                            label=f"{method} {int(ctx)}")
        ax.set_title(task, fontsize=9)
        ax.set_xscale("log", base=2)
        lo = min(0.1, 0.8 * acc["fraction"].min())  # a method holding less than 1/8 stays in view
        ticks = [f for f in (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2) if f >= lo]
        ax.set_xticks(ticks, [f"1/{round(1 / f)}" for f in ticks])
        ax.set_xlim(lo, 0.6)
        ax.set_ylim(-5, 105)
        ax.set_xlabel("total budget / context")
    for ax in axes.flat[len(tasks):]:
        ax.axis("off")
    axes[0][0].set_ylabel("score (%)")
    legend: dict[str, object] = {}
    for ax in axes.flat:  # every lane once, whichever panel has it
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    handles, labels = list(legend.values()), list(legend)
    fig.tight_layout()
    if handles:  # below the panels, after tight_layout so it never covers an axis label
        fig.legend(handles, labels, loc="upper center", ncol=min(6, len(labels)), fontsize=8,
                   bbox_to_anchor=(0.5, 0.0))
    return fig, save(fig, out_dir, name)
