"""Where does Quest's page selection spend its ~20 us a launch? (H200, 128K benchmark shape.)

Times per launch in a CUDA graph of 30 launches, as `bench_quest.bench_quest_select` does,
on random scores (B=6, Hkv=8, 8320 pages, top 92 of the middle pages):
- stages, from patched copies of `sparseengine/kernels/quest_select.py` written beside it
  (deleted after), each stopping the shortlist path at a later stage:
  `floor` (the row's count and its sink/recent slots only), `gmax` (+ the row's load in
  groups and the bound L), `candidates` (+ the pass writing the candidates >= L to scratch),
  `full` (the kernel as it is);
- `quest_select.L_BITS` (the bound's key bits, default 16) at 32 and 12.
(At 7304d35 also `CAND_FROM_GRID`, the candidates from the row's first load kept in
registers: 20.7 us at 8 warps, 23.6 at 16, against 16.6-16.8; removed.)
Every variant that is a whole selection is checked against the kernel's default output.

    python scripts/probe_quest_select_stages.py OUT.jsonl
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parents[1] / "sparseengine" / "kernels" / "quest_select.py"
NO_SEARCH = ("    partial = everything == 0  # some middle pages are chosen: a search\n",
             "    partial = (everything == 0) & (n < 0)  # probe: never (not provable at compile time)\n")
LOW = "        low = _kth_largest(gmax, g_ok, m, RADIX_BITS, L_BITS)\n"
CAND_LOOP = ("            for p0 in range(0, mid_end, BLOCK_P):\n                offs = p0 + tl.arange(0, BLOCK_P)\n"
             "                key = _page_keys(row, offs, P)\n                is_cand")
FINAL = "        if n_cand <= CAP:\n"
SWITCHES = [("L_BITS", 32, {}), ("L_BITS", 12, {})]


def _replace(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"probe patch does not match quest_select.py once: {old[:60]!r}")
    return text.replace(old, new)


def stages() -> dict[str, str]:
    src = SRC.read_text()
    gmax = _replace(src, LOW, LOW + "        tl.store(keys_out, low)\n")
    gmax = _replace(gmax, CAND_LOOP, CAND_LOOP.replace("range(0, mid_end, BLOCK_P)", "range(0, 0, BLOCK_P)"))
    return {"full": src, "floor": _replace(src, *NO_SEARCH), "gmax": _replace(gmax, FINAL, "        if n_cand < 0:\n"),
            "candidates": _replace(src, FINAL, "        if n_cand < 0:\n")}


def main(out_path: str) -> None:
    from sparseengine.kernels import quest_select, quest_select_pages_triton
    from sparseengine.kernels.bench_common import HKV, PS, per_launch_us

    B, P, n = 6, 8320, 131072
    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(B, HKV, P, generator=gen, device="cuda").to(torch.bfloat16).float()
    kv_lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    args = (scores, kv_lens, PS, 64, 512, 1472)
    want = quest_select_pages_triton(*args)  # the torch path does not promise ties to the earlier page
    meta = {"batch": B, "hkv": HKV, "pages": P, "kv_len": n, "device": torch.cuda.get_device_name(),
            "commit": os.environ.get("SPARSEENGINE_GIT_COMMIT", "unknown")}

    def record(f, name, fn, rnd):
        same = all(torch.equal(g, w) for g, w in zip(fn(), want))
        rec = {"kind": "quest_select_stage", "stage": name, "round": rnd, **meta,
               "us_per_launch": per_launch_us(fn), "equals_kernel": same}
        print(json.dumps(rec), flush=True)
        f.write(json.dumps(rec) + "\n")

    with open(out_path, "a") as f:
        for rnd in range(2):
            for name, text in stages().items():
                path = SRC.with_name(f"_probe_qs_{name}.py")
                path.write_text(text)
                try:
                    mod = importlib.import_module(f"sparseengine.kernels._probe_qs_{name}")
                    record(f, name, lambda: mod.quest_select_pages_triton(*args), rnd)
                finally:
                    path.unlink()
            for const, value, kw in SWITCHES:
                default = getattr(quest_select, const)
                setattr(quest_select, const, value)
                try:
                    name = f"{const}={value}" + "".join(f",{k}={v}" for k, v in kw.items())
                    record(f, name, lambda: quest_select_pages_triton(*args, **kw), rnd)
                finally:
                    setattr(quest_select, const, default)


if __name__ == "__main__":
    main(sys.argv[1])
