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
