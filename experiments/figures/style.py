"""Shared figure helpers: a headless backend, stable lane colours, saving PNG + PDF."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt  # noqa: E402

REFERENCE = "vanilla"


def colour(lane: str, lanes: list[str]):
    cmap = plt.get_cmap("tab10")
    if lane.startswith(REFERENCE):
        return "0.35"
    others = [x for x in lanes if not x.startswith(REFERENCE)]
    return cmap(others.index(lane) % 10)


def save(fig, out_dir: str | Path, name: str) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    return paths


def require_rows(table, what: str) -> None:
    if table.empty:
        raise ValueError(f"no {what} records to draw: the records hold no ok job of that task")


def budget_axis(ax, smallest: float) -> None:
    """An x axis of total budget / context on a log2 scale, ticks 1/64 .. 1/2; one below
    1/8 shows where a method held less (`smallest`: the least fraction drawn)."""
    ax.set_xscale("log", base=2)
    lo = min(0.1, 0.8 * smallest)
    ticks = [f for f in (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2) if f >= lo]
    ax.set_xticks(ticks, [f"1/{round(1 / f)}" for f in ticks])
    ax.set_xlim(lo, 0.6)
    ax.set_xlabel("total budget / context")


def shared_legend(fig, axes) -> None:
    """Every labelled line once, whichever panel has it, below the panels (after
    tight_layout, so it never covers an axis label)."""
    legend: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.tight_layout()
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="upper center", ncol=min(6, len(legend)), fontsize=8,
                   bbox_to_anchor=(0.5, 0.0))
