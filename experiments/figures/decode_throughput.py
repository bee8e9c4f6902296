"""The seed's two-panel figure: decode output tok/s at each lane's largest batch (top), and
the improvement over vanilla at the same concurrency, vanilla's largest batch (bottom)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.aggregate import improvement_over_vanilla
from experiments.figures.style import colour, plt, require_rows, save


def render(tp: pd.DataFrame, out_dir: str | Path, name: str = "decode_throughput"):
    require_rows(tp, "throughput")
    imp = improvement_over_vanilla(tp)
    key = tp.groupby(["model", "context_length"]).size().index[0]  # the first (model, context) setting
    sub = tp[(tp["model"] == key[0]) & (tp["context_length"] == key[1])]
    lanes = sorted(sub["lane"].unique(), key=lambda x: (not x.startswith("vanilla"), x))
    largest = [sub[sub["lane"] == ln].sort_values("batch").iloc[-1] for ln in lanes]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(5, 1.2 * len(lanes) + 2), 6.5), sharex=True)
    xs = range(len(lanes))
    bars = top.bar(xs, [r["output_tok_s"] for r in largest], color=[colour(ln, lanes) for ln in lanes])
    for bar, r in zip(bars, largest):
        top.annotate(f"{r['output_tok_s']:.0f}\nbs={int(r['batch'])}", (bar.get_x() + bar.get_width() / 2,
                     bar.get_height()), ha="center", va="bottom", fontsize=8)
    top.set_ylabel("output tok/s\n(largest batch)")
    top.set_title(f"Decode throughput, {key[0]}, {int(key[1])}-token prompts")
    top.margins(y=0.25)
    mine = imp[(imp["model"] == key[0]) & (imp["context_length"] == key[1])].set_index("lane")
    raw = [mine["improvement_pct"].get(ln) if ln in mine.index else None for ln in lanes]
    vals = [None if v is None or pd.isna(v) else float(v) for v in raw]  # None: not run at that batch
    conc = int(mine["concurrency"].iloc[0]) if len(mine) else None
    bottom.bar(xs, [v or 0.0 for v in vals], color=[colour(ln, lanes) for ln in lanes])
    for x, v in zip(xs, vals):
        bottom.annotate("n/a" if v is None else f"{v:+.0f}%", (x, v or 0.0), ha="center",
                        va="bottom", fontsize=8)
    bottom.axhline(0, color="0.5", lw=0.8)
    bottom.margins(y=0.15)
    where = f"at batch {conc} (%)" if conc else "(no vanilla lane)"
    bottom.set_ylabel(f"improvement over vanilla\n{where}")
    bottom.set_xticks(list(xs), lanes, rotation=20, ha="right")
    fig.tight_layout()
    return fig, save(fig, out_dir, name)
