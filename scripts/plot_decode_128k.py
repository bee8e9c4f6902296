"""Draw the seed's two-panel decode figure from results/decode_throughput_128k.csv.

    python scripts/plot_decode_128k.py
"""

from __future__ import annotations

import argparse

import pandas as pd

from experiments.figures.decode_throughput import render


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="results/decode_throughput_128k.csv")
    ap.add_argument("--out", default="results/figures")
    args = ap.parse_args()
    df = pd.read_csv(args.csv)
    df = df[df["output_tok_s"].notna()].copy()
    df["context_length"] = df["prompt_len"]
    df["sparse_method"] = df["lane"].where(df["lane"] != "vanilla", "vanilla")
    _, paths = render(df, args.out, name="decode_throughput_128k")
    print("\n".join(map(str, paths)))


if __name__ == "__main__":
    main()
