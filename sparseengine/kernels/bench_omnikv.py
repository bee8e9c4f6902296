"""OmniKV's token pick at the 128K decode benchmark's shape, the Triton pick beside the
torch path (`python -m sparseengine.kernels.bench_gpu --omnikv-select --out FILE`). Each
is timed per launch inside a CUDA graph of 30 launches, so launch overhead does not count,
though each of the torch path's kernels still costs its gap in the graph."""
from __future__ import annotations

import torch

from sparseengine.kernels.bench_gpu import BF16, D, HKV, HQ, PS, emit, per_launch_us


def bench_omnikv_select(out_path, B=6, L=133120, n=131072, sink=64, budget=1472, recent=512):
    """One filter layer's pick from its per-KV-head max logits `[B, Hkv, L]` (the graph's
    133120-token table): torch (max over heads, masking, top-k, sort) against the Triton
    pick (tokens per program, warps)."""
    from sparseengine.kernels import omnikv_select_triton
    from sparseengine.methods.omnikv import pick_tokens

    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(B, HKV, L, generator=gen, device="cuda")
    kv_lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    want = pick_tokens(scores.amax(1), kv_lens, sink, budget, recent)
    shape = {"batch": B, "hkv": HKV, "width": L, "kv_len": n, "sink": sink, "budget": budget, "recent": recent}
    torch_fn = lambda: pick_tokens(scores.amax(1), kv_lens, sink, budget, recent)  # noqa: E731
    emit(out_path, {"kind": "omnikv_select", "path": "torch", **shape, "us_per_launch": per_launch_us(torch_fn)})
    variants = [{}, dict(num_warps=2), dict(num_warps=8), dict(block=512), dict(block=512, num_warps=2),
                dict(block=2048), dict(block=2048, num_warps=8), dict(block=4096, num_warps=8)]
    for kw in variants:
        fn = lambda: omnikv_select_triton(scores, kv_lens, sink, budget, recent, **kw)  # noqa: E731
        same = all(torch.equal(g, w) for g, w in zip(fn(), want))
        emit(out_path, {"kind": "omnikv_select", "path": "triton", **shape, **kw,
                        "us_per_launch": per_launch_us(fn), "equals_torch_path": same})


def bench_pick_at_quest_shape(out_path, B=6, P=8320, n=131072):
    """The same pick on Quest's selection shape (a row per request and KV head:
    48 rows of 8320 page bounds, 4 sink + 92 + 32 recent pages; the page rule for a partial
    last page aside), beside `quest_select_pages_triton` on the same scores: is its
    search spread over blocks worth porting to Quest's selection?"""
    from sparseengine.kernels import omnikv_select_triton, quest_select_pages_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(B, HKV, P, generator=gen, device="cuda")
    kv_lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    rows = scores.view(B * HKV, 1, P)
    row_pages = torch.full((B * HKV,), n // PS, dtype=torch.int32, device="cuda")
    quest = lambda: quest_select_pages_triton(scores, kv_lens, PS, 64, 512, 1472)  # noqa: E731
    pages, _ = quest()
    for name, fn in (("quest_select_pages_triton", quest),
                     ("omnikv_select_triton", lambda: omnikv_select_triton(rows, row_pages, 4, 92, 32)),
                     ("omnikv_select_triton_b512", lambda: omnikv_select_triton(rows, row_pages, 4, 92, 32,
                                                                                block=512))):
        same = None
        if name.startswith("omnikv"):
            got = fn()[0].view(B, HKV, -1)  # Quest's width holds one slot more for a partial page
            same = torch.equal(got, pages[..., :got.shape[-1]]) and bool((pages[..., got.shape[-1]:] == -1).all())
        emit(out_path, {"kind": "pick_at_quest_shape", "kernel": name, "rows": B * HKV, "pages": P,
                        "us_per_launch": per_launch_us(fn), "same_pages_as_quest": same})


def bench_omnikv_attention(out_path, B=6, P=8320, n=131072, sink=64, budget=1472, recent=512):
    """OmniKV's sparse layers' attention at the 128K shape: one set of `sink + budget +
    recent` tokens a request (the sink, `budget` random middle tokens, the recent window;
    ascending), shared by the 8 KV heads (OmniKV's selection: a stride-0 view), over an
    8320-page table scattered over the pool, per launch in a CUDA graph of 30 (the merge
    launch included): the split planner's launch (the engine's until session 30) against
    fixed chunks of the selection's tokens, tiles, warps and stages; each checked against
    the planner's output."""
    from sparseengine.kernels import sparse_decode_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = B * P
    k_cache, v_cache = (torch.randn(pool, PS, HKV, D, generator=gen, device="cuda").to(BF16) for _ in range(2))
    table = torch.randperm(pool, generator=gen, device="cuda").int().view(B, P)
    kv_lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, generator=gen, device="cuda").to(BF16)
    middle = torch.rand(B, n - sink - recent, generator=gen, device="cuda").argsort(-1)[:, :budget] + sink
    idx = torch.cat([torch.arange(sink, device="cuda").expand(B, sink), middle.sort(-1).values,
                     torch.arange(n - recent, n, device="cuda").expand(B, recent)], 1).int()
    width = idx.shape[1]
    sel = idx[:, None, :].expand(B, HKV, width)
    counts = torch.full((B, HKV), width, dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, table, kv_lens, sel, counts)
    want = sparse_decode_triton(*args).float()
    nbytes = 2 * B * HKV * width * D * 2
    configs = [dict()]
    for chunk, block_n, num_warps, num_stages in ((128, 32, 4, 2), (128, 64, 4, 2), (128, 32, 4, 3), (128, 32, 2, 2),
                                                  (256, 32, 4, 2), (256, 64, 4, 3), (256, 32, 4, 3), (64, 32, 4, 2),
                                                  (64, 64, 4, 2), (64, 16, 2, 2), (512, 64, 4, 3), (128, 16, 2, 2)):
        configs.append(dict(kv_chunk=chunk, block_n=block_n, num_warps=num_warps, num_stages=num_stages))
    for kw in configs:
        fn = lambda: sparse_decode_triton(*args, **kw)  # noqa: E731
        err = (fn().float() - want).abs().max().item()
        us = per_launch_us(fn)
        emit(out_path, {"kind": "omnikv_attention", "batch": B, "hkv": HKV, "tokens": width, "kv_len": n, **kw,
                        "us_per_launch": us, "GBps": nbytes / us / 1e3, "max_abs_diff_vs_planner": err})
