"""Probe (GPU): the same sparse-page (Quest's 128K shape) and dense decode kernels over an
NHD cache against a head-major (HND) one seen through an NHD-shaped view (the kernels
index by strides), page tables random and contiguous.

    python scripts/probe_kv_layout.py OUT.jsonl

Measured on the H200 (results/tried_not_kept_h200.jsonl, kind kv_layout): the same times
within 1.5%, so the cache keeps its NHD layout."""
import json
import sys

import torch

from sparseengine.kernels import paged_decode_triton, sparse_page_decode_triton
from sparseengine.kernels.bench_common import BF16, D, HKV, HQ, PS, per_launch_us


def caches(pool, layout, gen):
    if layout == "NHD":
        return [torch.randn(pool, PS, HKV, D, generator=gen, device="cuda").to(BF16) for _ in range(2)]
    return [torch.randn(pool, HKV, PS, D, generator=gen, device="cuda").to(BF16).permute(0, 2, 1, 3) for _ in range(2)]


def main(path):
    out = []
    B, P, n, width = 6, 8320, 131072, 129
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = B * P
    for table_kind in ("random", "contiguous"):
        table = (torch.randperm(pool, generator=gen, device="cuda") if table_kind == "random"
                 else torch.arange(pool, device="cuda")).int().view(B, P)
        kv_lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
        q = torch.randn(B, HQ, D, generator=gen, device="cuda").to(BF16)
        chosen = torch.rand(B, HKV, n // PS, generator=gen, device="cuda").argsort(-1)[..., :width]
        pages = chosen.sort(-1).values.contiguous()
        counts = torch.full((B, HKV), width, dtype=torch.int32, device="cuda")
        for layout in ("NHD", "HND", "NHD", "HND"):
            k, v = caches(pool, layout, gen)
            for chunk, bn, w, st in ((None, None, None, None), (128, 32, 4, 2), (128, 64, 4, 2), (256, 64, 4, 3),
                                     (64, 16, 2, 2)):
                kw = {} if chunk is None else dict(kv_chunk=chunk, block_n=bn, num_warps=w, num_stages=st)
                fn = lambda: sparse_page_decode_triton(q, k, v, table, kv_lens, pages, counts, **kw)
                us = per_launch_us(fn)
                r = {"probe": "sparse", "table": table_kind, "layout": layout, **kw, "us": us,
                     "GBps": 2 * B * HKV * width * PS * D * 2 / us / 1e3}
                out.append(r); print(json.dumps(r), flush=True)
            for b in (1, 6):
                fn = lambda: paged_decode_triton(q[:b], k, v, table[:b], kv_lens[:b])
                us = per_launch_us(fn, launches=10)
                r = {"probe": "dense", "table": table_kind, "layout": layout, "batch": b, "us": us,
                     "GBps": 2 * b * n * HKV * D * 2 / us / 1e3}
                out.append(r); print(json.dumps(r), flush=True)
            del k, v
            torch.cuda.empty_cache()
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in out)


if __name__ == "__main__":
    main(sys.argv[1])
