"""Quest's page scores at the 128K decode benchmark's shape (B=6, 8 KV heads, 8320 pages)
over two layouts of the page bounds: `separate` (kmax and kmin, two `[pages, Hkv, d]`
tensors, the engine's) and `interleaved` (one `[pages, Hkv, 2, d]` tensor, kmax and kmin
its two views: a (page, head)'s bounds in one 512-byte run), each with a random and a
contiguous page table, over a few launch configurations; per launch in a CUDA graph of 30
(`bench_common.per_launch_us`), each output checked against the default launch on the
separate layout over the request's pages (the kernel leaves tiles wholly past them unwritten).

    python scripts/probe_quest_bounds_layout.py OUT.jsonl [--layouts separate] [--tables contiguous]
        [--configs 64,4,4,2 32,8,2,2 ...]   (block_p,iters,num_warps,num_stages; 0 stages: the default)
"""
from __future__ import annotations

import argparse
import subprocess

import torch

from sparseengine.kernels import quest_page_scores_triton
from sparseengine.kernels.bench_common import emit, per_launch_us

B, P, N, HKV, HQ, D, PS = 6, 8320, 131072, 8, 32, 128, 16
CONFIGS = ((64, 2, 4, 2), (64, 1, 4, None), (32, 1, 2, None), (64, 2, 4, 3), (32, 2, 2, 2), (64, 2, 8, 2),
           (128, 1, 8, 2), (128, 2, 8, 3))


def bounds(layout: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    pool = B * P
    hi = torch.randn(pool, HKV, D, generator=gen, device="cuda").bfloat16()
    lo = hi - torch.rand(pool, HKV, D, generator=gen, device="cuda").bfloat16()
    if layout == "separate":
        return hi, lo
    both = torch.stack((hi, lo), dim=2)  # [pool, Hkv, 2, D]
    return both[:, :, 0], both[:, :, 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layouts", nargs="+", default=["separate", "interleaved"], choices=["separate", "interleaved"])
    ap.add_argument("--tables", nargs="+", default=["random", "contiguous"], choices=["random", "contiguous"])
    ap.add_argument("--configs", nargs="+", default=None, help="block_p,iters,num_warps,num_stages (0: default)")
    args = ap.parse_args()
    configs = CONFIGS if args.configs is None else [
        tuple(int(v) or None for v in c.split(",")) for c in args.configs]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    emit(args.out, {"kind": "meta", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "commit": commit, "command": "python scripts/probe_quest_bounds_layout.py OUT " + " ".join(
                        f"--{k} {' '.join(v)}" for k, v in vars(args).items() if k != "out" and v)})
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, HQ, D, generator=gen, device="cuda").bfloat16()
    kv_lens = torch.full((B,), N, dtype=torch.int32, device="cuda")
    tables = {"random": torch.randperm(B * P, generator=gen, device="cuda").int().view(B, P),
              "contiguous": torch.arange(B * P, device="cuda", dtype=torch.int32).view(B, P)}
    tables = {k: tables[k] for k in args.tables}
    nbytes = 2 * B * (N // PS) * HKV * D * 2
    sep = bounds("separate", torch.Generator(device="cuda").manual_seed(1))
    for layout in args.layouts:
        hi, lo = bounds(layout, torch.Generator(device="cuda").manual_seed(1))
        assert torch.equal(hi, sep[0]) and torch.equal(lo, sep[1])
        for table_kind, table in tables.items():
            want = quest_page_scores_triton(q, *sep, table, kv_lens, PS)
            for block_p, iters, warps, stages in configs:
                fn = lambda: quest_page_scores_triton(q, hi, lo, table, kv_lens, PS, block_p=block_p,  # noqa: E731
                                                      iters=iters, num_warps=warps, num_stages=stages)
                # the request's pages only: tiles wholly past them are left unwritten
                err = (fn()[..., :N // PS] - want[..., :N // PS]).abs().max().item()
                us = per_launch_us(fn)
                emit(args.out, {"kind": "quest_bounds_layout", "layout": layout, "table": table_kind,
                                "block_p": block_p, "iters": iters, "num_warps": warps, "num_stages": stages,
                                "us_per_launch": round(us, 2), "GBps": round(nbytes / us / 1e3),
                                "max_abs_diff_vs_default": err})
                print(layout, table_kind, block_p, iters, warps, stages, round(us, 2), round(nbytes / us / 1e3),
                      err, flush=True)


if __name__ == "__main__":
    main()
