"""Records to pandas, and the summaries the figures draw.

    python -m experiments.aggregate runs/records.jsonl --out results   # CSVs + figures

Columns keep the record's names: engine fields as they are (``sparse_method``, ``budget``
...), task parameters as they are unless they clash (then ``task.<name>``), metrics with
their ``/`` namespaces, provenance as ``provenance.<name>``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from experiments.records import read_records


def flatten(rec: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {k: rec.get(k) for k in ("task", "status", "error", "start_time", "end_time", "job_dir")}
    row.update(rec.get("engine") or {})
    for k, v in (rec.get("task_config") or {}).items():
        if k != "name":
            row[k if k not in row else f"task.{k}"] = v
    run = rec.get("run") or {}
    row["budget_fraction"] = run.get("budget_fraction")
    row["experiment"] = (run.get("choices") or {}).get("experiment")
    row.update(rec.get("metrics") or {})
    for k, v in (rec.get("provenance") or {}).items():
        if isinstance(v, dict):
            row.update({f"provenance.{k}.{kk}": vv for kk, vv in v.items()})
        else:
            row[f"provenance.{k}"] = v
    return row


def load_records(paths: str | Path | Iterable[str | Path], status: str | None = "ok") -> pd.DataFrame:
    """Every record of the given JSONL files, one row each (``status=None`` keeps all)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    rows = [flatten(r) for p in paths for r in read_records(p)]
    df = pd.DataFrame(rows)
    if status is not None and not df.empty:
        df = df[df["status"] == status].reset_index(drop=True)
    return df


def total_budget(row) -> int:
    """Tokens the method keeps per layer: sink + budget + recent, without ``budget`` for a
    method that leaves it unused (its registry ``budget_knob`` is ``recent_tokens``)."""
    from sparseengine.method_registry import get_spec

    try:
        uses_budget = get_spec(str(row["sparse_method"])).budget_knob == "budget"
    except Exception:  # a method no longer registered: the plain sum
        uses_budget = True
    return int(row["sink_tokens"] + row["recent_tokens"] + (row["budget"] if uses_budget else 0))


def lane(row: pd.Series) -> str:
    """A throughput/accuracy lane: the method, its total budget unless dense, any prefill method."""
    from sparseengine.method_registry import get_spec

    name = str(row["sparse_method"])
    try:
        dense = get_spec(name).family == "dense"
    except Exception:  # a method no longer registered still gets a label
        dense = name == "vanilla"
    if not dense:
        name += f" (total {total_budget(row)})"
    if row.get("prefill_sparse_method") not in (None, "none"):
        name += f" + {row['prefill_sparse_method']}"
    plan = row.get("decode_split_plan")
    if isinstance(plan, str) and plan != "auto":
        name += f" [{plan} split plan]"
    return name


def held_fraction(row, total: int) -> float | None:
    """The sweep's ``budget_fraction`` where the method held it (``total`` tokens of the
    context), else None (its budget was unused)."""
    frac = row.get("budget_fraction")
    if frac is None or pd.isna(frac) or round(float(frac) * row["context_length"]) != total:
        return None
    return float(frac)


def accuracy_table(df: pd.DataFrame) -> pd.DataFrame:
    """Long form: one row per (record, scored task), ``score`` in percent."""
    out = []
    for _, row in df.iterrows():
        for col in df.columns:
            m = re.fullmatch(r"(passkey|ruler|longbench)(?:/(.+))?/score", col)
            if m is None or pd.isna(row[col]):
                continue
            total = total_budget(row)
            frac = held_fraction(row, total)
            out.append({"task": m.group(1) + (f"/{m.group(2)}" if m.group(2) else ""),
                        "sparse_method": row["sparse_method"], "prefill_sparse_method": row["prefill_sparse_method"],
                        "model": row["model"], "context_length": row["context_length"],
                        "budget_fraction": frac, "total_budget": total,
                        "score": row[col], "num_samples": row.get(col.replace("/score", "/num_samples")),
                        "seed": row["seed"], "device": row.get("provenance.device")})
    table = pd.DataFrame(out)
    if table.empty:
        return table
    keys = ["task", "sparse_method", "prefill_sparse_method", "model", "context_length", "total_budget", "seed"]
    return table.drop_duplicates(keys, keep="last").reset_index(drop=True)  # a rerun cell supersedes


FIDELITY_METRICS = ("decode_kl_mean", "decode_kl_max", "decode_teacher_forced_top1", "attention_output_rel_error",
                    "top1_agreement", "prefix_match_tokens", "kl_mean", "kl_max", "teacher_forced_top1",
                    "decode_preemptions", "num_samples")


def fidelity_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per fidelity record: the method, what it held (``total_budget``, and the
    sweep's ``budget_fraction`` where it held it) and the ``fidelity/`` metrics without
    their prefix (``experiments/tasks/fidelity.py`` defines them). A cell measured again
    (same method, model, context, budget, reference and seed) keeps its latest record."""
    out = []
    fid = df[df["task"] == "fidelity"] if "task" in df.columns else df.iloc[0:0]
    if "end_time" in fid.columns:
        fid = fid.sort_values("end_time", kind="stable")
    for _, row in fid.iterrows():
        total = total_budget(row)
        frac = held_fraction(row, total)
        entry = {"sparse_method": row["sparse_method"], "prefill_sparse_method": row["prefill_sparse_method"],
                 "model": row["model"], "context_length": row["context_length"], "budget_fraction": frac,
                 "total_budget": total, "reference_method": row.get("fidelity/reference_method"),
                 "seed": row["seed"], "device": row.get("provenance.device"),
                 "commit": row.get("provenance.git_commit")}
        entry.update({k: row.get(f"fidelity/{k}") for k in FIDELITY_METRICS})
        out.append(entry)
    table = pd.DataFrame(out)
    if table.empty:
        return table
    keys = ["sparse_method", "prefill_sparse_method", "model", "context_length", "total_budget",
            "reference_method", "seed"]
    return table.drop_duplicates(keys, keep="last").sort_values(keys[:5]).reset_index(drop=True)


def throughput_table(df: pd.DataFrame) -> pd.DataFrame:
    """Long form: one row per (throughput record, measured batch size), plus the Hugging Face
    ``generate`` lane (``hf/bs<B>/``) where a record has one. A lane measured again (a later
    record with the same lane, model, context and batch) replaces the earlier row, and an
    earlier row at a batch the latest record found does not fit (above its largest batch,
    where it searched one: ``first_unfit_batch``) goes: a stale largest batch would stand
    in for the lane's largest."""
    out = []
    tp = df[df["task"] == "throughput"]
    if "end_time" in tp.columns:
        tp = tp.sort_values("end_time", kind="stable")
    for _, row in tp.iterrows():
        mix = row.get("decode/length_mix")
        common = {"model": row["model"], "context_length": row["context_length"],
                  "length_mix": mix if isinstance(mix, str) else str(row["context_length"]) + "x1",
                  "device": row.get("provenance.device_name"), "provider": row.get("attention/provider"),
                  "commit": row.get("provenance.git_commit"), "dirty": row.get("provenance.git_dirty")}
        for prefix, name, method in (("decode", lane(row), row["sparse_method"]), ("hf", "hf_generate", "hf")):
            batches = sorted({int(m.group(1)) for c in tp.columns
                              if (m := re.fullmatch(prefix + r"/bs(\d+)/output_tok_s", c)) and pd.notna(row[c])})
            for b in batches:
                entry = {"lane": name, "sparse_method": method, **common, "batch": b,
                         "max_batch": row.get("decode/max_batch") if prefix == "decode" else b,
                         "first_unfit_batch": row.get("decode/first_unfit_batch") if prefix == "decode" else None}
                for key in ("output_tok_s", "step_s", "step_s_median", "pct_of_limit", "limit_tok_s",
                            "bytes_per_step", "ttft_s_mean", "tpot_s_mean", "kv_tokens_mean", "preemptions",
                            "cold_output_tok_s", "prompt_tokens_mean", "gpu_sm_mhz_mean", "gpu_power_w_mean",
                            "gpu_power_capped_share"):  # gpu_*: the clocks through the window (gpu_clocks)
                    entry[key] = row.get(f"{prefix}/bs{b}/{key}")
                entry["bandwidth_gbps"] = row.get("roofline/bandwidth_gbps")
                out.append(entry)
    table = pd.DataFrame(out)
    if table.empty:
        return table
    keys = ["lane", "model", "context_length", "length_mix", "batch"]
    latest = table.groupby(keys[:-1], dropna=False)[["max_batch", "first_unfit_batch"]].transform(
        lambda col: col.iloc[-1])  # the latest record's (rows are in record order)
    unfit = latest["first_unfit_batch"].notna() & (table["batch"] > latest["max_batch"])
    table = table[~unfit]
    return table.drop_duplicates(keys, keep="last").sort_values(keys).reset_index(drop=True)


def improvement_over_vanilla(tp: pd.DataFrame, reference: str = "vanilla") -> pd.DataFrame:
    """Each lane at the reference lane's largest batch, as a ratio of the reference's tok/s
    (per model, context and length mix)."""
    rows = []
    keys = ["model", "context_length"] + (["length_mix"] if "length_mix" in tp.columns else [])
    for (model, ctx, *_), group in tp.groupby(keys):
        ref = group[group["lane"] == reference]
        if ref.empty:
            continue
        at = int(ref["batch"].max())
        ref_tok = float(ref[ref["batch"] == at]["output_tok_s"].iloc[0])
        for name, lane_rows in group.groupby("lane"):
            same = lane_rows[lane_rows["batch"] == at]
            largest = lane_rows[lane_rows["batch"] == lane_rows["batch"].max()].iloc[0]
            rows.append({"model": model, "context_length": ctx, "lane": name, "concurrency": at,
                         "output_tok_s_at_concurrency": float(same["output_tok_s"].iloc[0]) if len(same) else None,
                         "improvement_pct": (100.0 * (float(same["output_tok_s"].iloc[0]) / ref_tok - 1))
                         if len(same) else None,
                         "largest_batch": int(largest["batch"]), "output_tok_s_at_largest": largest["output_tok_s"]})
    return pd.DataFrame(rows, columns=["model", "context_length", "lane", "concurrency", "output_tok_s_at_concurrency",
                                       "improvement_pct", "largest_batch", "output_tok_s_at_largest"])


def main(argv: list[str] | None = None) -> None:
    from experiments.figures import render_all

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", help="records JSONL file(s)")
    ap.add_argument("--out", default="results", help="folder for CSVs; figures go to <out>/figures")
    args = ap.parse_args(argv)
    df = load_records(args.records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    acc, tp, fid = accuracy_table(df), throughput_table(df), fidelity_table(df)
    for name, table in (("accuracy", acc), ("throughput", tp), ("fidelity", fid)):
        if not table.empty:
            table.to_csv(out / f"{name}.csv", index=False)
    for path in render_all(df, out / "figures"):
        print(path)


if __name__ == "__main__":
    main()
