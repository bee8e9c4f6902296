"""The chunked prefill's launches side by side on the GPU (`bench_gpu --prefill-launches`):
tile rows, key block, warps, stages and the split of unmasked from diagonal blocks
(`paged_prefill.PrefillLaunch`), each timed with `triton.testing.do_bench` (median) and
checked against the default launch's output on the same inputs."""
from __future__ import annotations

import torch

from .bench_common import BF16, D, HKV, HQ, PS, emit
from .paged_prefill import paged_prefill_triton, prefill_launch
from .testing import random_paged_kv

# Swept launches (the GPU test runs each against the reference); the first is the launch
# before session 34; the module's defaults for the device are among them (each row says).
PREFILL_LAUNCHES = (
    dict(block_rows=64, block_n=64, num_warps=4, num_stages=2, split_mask=False),
    dict(block_rows=64, block_n=64, num_warps=4, num_stages=2, split_mask=True),
    dict(block_rows=64, block_n=64, num_warps=4, num_stages=3, split_mask=True),
    dict(block_rows=128, block_n=64, num_warps=8, num_stages=3, split_mask=True),
    dict(block_rows=128, block_n=128, num_warps=8, num_stages=3, split_mask=True),
    dict(block_rows=128, block_n=32, num_warps=4, num_stages=3, split_mask=True),
    dict(block_rows=256, block_n=64, num_warps=8, num_stages=3, split_mask=True),
    dict(block_rows=256, block_n=128, num_warps=8, num_stages=2, split_mask=True),
    dict(block_rows=256, block_n=128, num_warps=8, num_stages=3, split_mask=True),
)
# (cached tokens before the chunk + chunk, chunk): a chunk at the end of a long prompt, and a
# whole prompt in one pass (the TTFT benchmark's prefill)
PREFILL_SHAPES = ((32768, 4096), (131072, 16384), (32768, 32768))


def causal_flops(ctx: int, chunk: int) -> int:
    """Multiply-adds x 2 of QK^T and PV for a chunk's rows over the keys each sees."""
    return 4 * HQ * D * sum(ctx - chunk + i + 1 for i in range(chunk))


def bench_prefill_launches(out_path, shapes=PREFILL_SHAPES, launches=PREFILL_LAUNCHES):
    from triton.testing import do_bench

    for ctx, chunk in shapes:
        kv = random_paged_kv([ctx], HKV, D, PS, generator=torch.Generator().manual_seed(0), dtype=BF16,
                             device="cuda", poison=False)
        q = torch.randn(chunk, HQ, D, device="cuda", dtype=BF16, generator=torch.Generator("cuda").manual_seed(1))
        cu = torch.tensor([0, chunk], device="cuda", dtype=torch.int32)
        args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu)
        want = paged_prefill_triton(*args, max_q_len=chunk, min_q_len=chunk)
        default = prefill_launch(device=q.device, head_dim=D, min_q_len=chunk)
        flops = causal_flops(ctx, chunk)
        for kw in launches:
            launch = prefill_launch(**kw, device=q.device, head_dim=D, min_q_len=chunk)
            row = {"kind": "prefill_launch", "kv_len": ctx, "q_len": chunk, **vars(launch),
                   "default": launch == default}
            try:
                got = paged_prefill_triton(*args, max_q_len=chunk, min_q_len=chunk, **kw)
                ms = do_bench(lambda: paged_prefill_triton(*args, max_q_len=chunk, min_q_len=chunk, **kw),
                              return_mode="median")
                emit(out_path, {**row, "ms": ms, "TFLOPs": flops / ms / 1e9,
                                "max_abs_diff_vs_default": (got.float() - want.float()).abs().max().item()})
            except Exception as e:  # noqa: BLE001 - record it and go on to the next launch
                emit(out_path, {**row, "error": repr(e)[:500]})
