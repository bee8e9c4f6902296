"""Quest's kernels at the 128K decode benchmark's shape, variants side by side on the GPU
(`python -m sparseengine.kernels.bench_gpu --quest-select --out FILE`): the page
selection (full search against the shortlist, its radix, groups and room) and the page
scores (pages per program, warps; the decode step's bounds folded in or updated first).
Each is timed per launch inside a CUDA graph of 30 launches, so launch overhead does not
count."""
from __future__ import annotations

import torch

from sparseengine.kernels.bench_common import BF16, D, HKV, HQ, PS, emit, per_launch_us


def bench_quest_select(out_path, B=6, P=8320, n=131072):
    """Quest's page selection at the 128K decode benchmark's shape (the graph's page table
    is 8320 pages wide), per launch in a CUDA graph of 30 launches (no launch overhead):
    the full search (radix 2, blocks of 8192 pages) against the shortlist first (radix 1,
    2, 4; groups and room)."""
    from sparseengine.kernels import quest_select_pages_triton
    from sparseengine.methods.quest import select_pages_batched

    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(B, HKV, P, generator=gen, device="cuda").to(torch.bfloat16).float()
    kv_lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    args = (scores, kv_lens, PS, 64, 512, 1472)
    want = select_pages_batched(*args)
    variants = [dict(radix_bits=2, shortlist=False), dict(radix_bits=1), dict(radix_bits=2), dict(radix_bits=4),
                dict(radix_bits=2, max_groups=2048, shortlist_cap=1024), dict(radix_bits=2, max_groups=256),
                dict(radix_bits=2, max_groups=1024), dict(radix_bits=4, num_warps=4), dict(radix_bits=4, num_warps=8),
                dict(radix_bits=4, block_p=4096, num_warps=8), dict(radix_bits=4, block_p=2048, num_warps=4)]
    for kw in variants:
        fn = lambda: quest_select_pages_triton(*args, **kw)  # noqa: E731
        same = all(torch.equal(g, w) for g, w in zip(fn(), want))
        emit(out_path, {"kind": "quest_select", "batch": B, "hkv": HKV, "pages": P, "kv_len": n,
                        **kw, "us_per_launch": per_launch_us(fn), "equals_torch_path": same})


def _score_inputs(B, P, n):
    """q and random page bounds (min below max) over a pool of B * P pages, B page tables
    scattered over it, kv_lens all n: the page scores' inputs at the 128K shape (seeded)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = B * P
    kmax = torch.randn(pool, HKV, D, generator=gen, device="cuda").to(BF16)
    kmin = kmax - torch.rand(pool, HKV, D, generator=gen, device="cuda").to(BF16)
    table = torch.randperm(pool, generator=gen, device="cuda").int().view(B, P)
    kv_lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, generator=gen, device="cuda").to(BF16)
    return q, kmax, kmin, table, kv_lens


def bench_quest_scores(out_path, B=6, P=8320, n=131072):
    """Quest's page scores at the 128K decode benchmark's shape (pages scattered over a
    pool of B * P pages), per launch in a CUDA graph of 30 launches: pages per program x
    warps."""
    from sparseengine.kernels import quest_page_scores_triton

    q, kmax, kmin, table, kv_lens = _score_inputs(B, P, n)
    args = (q, kmax, kmin, table, kv_lens, PS)
    want = quest_page_scores_triton(*args)
    nbytes = 2 * B * (n // PS) * HKV * D * 2
    for block_p, iters, num_warps, num_stages in (
            (64, 1, 4, None), (32, 1, 2, None), (128, 1, 4, None), (64, 2, 4, 2), (64, 2, 4, 3), (64, 4, 4, 3),
            (32, 4, 2, 3), (32, 4, 4, 3), (64, 4, 8, 3), (128, 2, 8, 3), (32, 8, 4, 4), (64, 8, 4, 4)):
        fn = lambda: quest_page_scores_triton(*args, block_p=block_p, iters=iters,  # noqa: E731
                                              num_warps=num_warps, num_stages=num_stages)
        err = (fn() - want).abs().nan_to_num(0.0).max().item()
        us = per_launch_us(fn)
        emit(out_path, {"kind": "quest_scores", "batch": B, "hkv": HKV, "pages": P, "kv_len": n,
                        "block_p": block_p, "iters": iters, "num_warps": num_warps, "num_stages": num_stages,
                        "us_per_launch": us, "GBps": nbytes / us / 1e3, "max_abs_diff_vs_default": err})
    bench_quest_fold(out_path, q, kmax, kmin, table, kv_lens)


# The scoring launches `bench_quest_score_launches` sweeps: (pages a tile, tiles a program, warps,
# stages, keep the tiles' scores in registers until after the loop). Session 32 (results/
# quest_scores_s32.jsonl) also swept, at commits 7721715 and 21e679e, two variants since removed:
# the pages as the dot's rows and each tile's loads issued before the tile before is scored.
SCORE_LAUNCHES = [dict(zip(("block_p", "iters", "num_warps", "num_stages", "keep_tiles"), c))
                  for c in ((64, 2, 4, 2, False), (64, 2, 4, 2, True), (64, 2, 4, 1, False), (64, 2, 4, 1, True),
                            (64, 4, 4, 1, True), (64, 2, 8, 1, True), (32, 4, 4, 1, True), (128, 2, 8, 1, True),
                            (64, 4, 4, 2, True), (64, 4, 4, 3, True), (64, 8, 4, 3, True), (32, 4, 2, 3, True),
                            (32, 8, 2, 3, True), (128, 2, 8, 3, True))]


def bench_quest_score_launches(out_path, B=6, P=8320, n=131072):
    """The page scores as Quest's decode step launches them (the step's keys folded in, the
    shortlist's group maxima of 32 pages from the same launch; sink 64, recent 512 tokens) at
    the 128K shape, pages scattered over a pool of B * P pages, per launch in a CUDA graph of
    30 launches: each of `SCORE_LAUNCHES`, checked against the default launch's output."""
    from sparseengine.kernels.quest_scores import quest_page_scores_and_maxima_triton

    q, kmax, kmin, table, kv_lens = _score_inputs(B, P, n)
    k_cache = torch.randn(kmax.shape[0], PS, HKV, D, device="cuda").to(BF16)
    slots = table[:, (n - 1) // PS].long() * PS + (n - 1) % PS
    args = (q, kmax, kmin, table, kv_lens, PS)
    step = dict(group=32, sink_pages=4, recent_tokens=512, k_cache=k_cache, new_slots=slots)
    want = quest_page_scores_and_maxima_triton(*args, **step)
    nbytes = 2 * B * (n // PS) * HKV * D * 2
    pages, groups = -(-n // PS), -(-n // PS // 32)  # what a launch writes: the request's pages and their groups
    for launch in SCORE_LAUNCHES:
        fn = lambda: quest_page_scores_and_maxima_triton(*args, **step, **launch)  # noqa: E731
        got = fn()
        err = (got[0][..., :pages] - want[0][..., :pages]).abs().max().item()
        us = per_launch_us(fn)
        emit(out_path, {"kind": "quest_score_launch", "batch": B, "hkv": HKV, "pages": P, "kv_len": n, **launch,
                        "us_per_launch": us, "GBps": nbytes / us / 1e3, "max_abs_diff_vs_default": err,
                        "maxima_equal_default": torch.equal(got[1][..., :groups], want[1][..., :groups])})


def bench_quest_fold(out_path, q, kmax, kmin, table, kv_lens):
    """A decode step's bounds update then the scores (two launches) against the scoring
    that folds the step's keys in (one), per step in a CUDA graph of 30 steps."""
    from sparseengine.kernels import quest_page_scores_triton, update_page_minmax_triton

    B, P = table.shape
    k_cache = torch.randn(kmax.shape[0], PS, HKV, D, device="cuda").to(BF16)
    n = int(kv_lens[0])
    slots = table[:, (n - 1) // PS].long() * PS + (n - 1) % PS
    bounds = kmax.clone(), kmin.clone()
    runs = {"update_then_scores": lambda: (update_page_minmax_triton(k_cache, slots, *bounds),
                                           quest_page_scores_triton(q, *bounds, table, kv_lens, PS))[1],
            "fold_in_scores": lambda: quest_page_scores_triton(q, *bounds, table, kv_lens, PS, k_cache=k_cache,
                                                               new_slots=slots)}
    want = runs["update_then_scores"]()
    for name, fn in runs.items():
        emit(out_path, {"kind": "quest_fold", "variant": name, "batch": B, "hkv": HKV, "pages": P, "kv_len": n,
                        "us_per_step": per_launch_us(fn), "equals_update_then_scores": torch.equal(fn(), want)})


def _attention_inputs(B, P, n, gen):
    """q, a K/V pool of B * P pages, B page tables scattered over it, kv_lens all n."""
    pool = B * P
    k_cache, v_cache = (torch.randn(pool, PS, HKV, D, generator=gen, device="cuda").to(BF16) for _ in range(2))
    table = torch.randperm(pool, generator=gen, device="cuda").int().view(B, P)
    kv_lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, generator=gen, device="cuda").to(BF16)
    return q, k_cache, v_cache, table, kv_lens


def _chosen_pages_case(B, P, n, width):
    """The sparse-page attention's arguments at the 128K shape (`width` random pages a
    (request, KV head), ascending), the default launch's output (float32), and the K/V
    bytes a launch reads."""
    from sparseengine.kernels import sparse_page_decode_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k_cache, v_cache, table, kv_lens = _attention_inputs(B, P, n, gen)
    chosen = torch.rand(B, HKV, n // PS, generator=gen, device="cuda").argsort(-1)[..., :width]
    pages = chosen.sort(-1).values.contiguous()
    counts = torch.full((B, HKV), width, dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, table, kv_lens, pages, counts)
    return args, sparse_page_decode_triton(*args).float(), 2 * B * HKV * width * PS * D * 2


def bench_quest_attention(out_path, B=6, P=8320, n=131072, width=129):
    """Quest's sparse layers' attention at the 128K decode benchmark's shape: every (request,
    KV head) attends over `width` chosen pages (4 sink + 92 top + 33 recent) of an
    8320-page table scattered over the pool, per launch in a CUDA graph of 30 launches:
    the split plan (tokens per split) x tile x warps x stages, the splits merged by a second
    kernel or by each row's last program."""
    from sparseengine.kernels import sparse_page_decode_triton

    args, want, nbytes = _chosen_pages_case(B, P, n, width)
    for chunk, block_n, num_warps, num_stages, fused in (
            (None, 64, 4, 2, None), (128, 64, 4, 2, None), (128, 32, 4, 2, None), (128, 32, 2, 3, None),
            (64, 32, 2, 2, None), (64, 16, 2, 2, None), (256, 32, 4, 3, None), (256, 64, 4, 3, None),
            (512, 64, 4, 3, None), (128, 64, 4, 3, None), (64, 64, 4, 2, None), (2048, 64, 4, 3, None),
            (128, 32, 4, 2, True), (256, 64, 4, 3, True), (256, 32, 4, 2, True)):
        fn = lambda: sparse_page_decode_triton(*args, kv_chunk=chunk, block_n=block_n,  # noqa: E731
                                               num_warps=num_warps, num_stages=num_stages, fused_combine=fused)
        err = (fn().float() - want).abs().max().item()
        us = per_launch_us(fn)
        emit(out_path, {"kind": "quest_attention", "batch": B, "hkv": HKV, "pages": width, "kv_len": n,
                        "kv_chunk": chunk, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages,
                        "merge": "last program" if fused else "second kernel",
                        "us_per_launch": us, "GBps": nbytes / us / 1e3, "max_abs_diff_vs_default": err})


def bench_quest_attention_splits(out_path, B=6, P=8320, n=131072, width=129):
    """Quest's sparse-page attention at the 128K shape (as `bench_quest_attention`), the
    grid's splits a row: fixed 64- and 128-token chunks (the default) against each row
    cutting its own chosen pages into `row_splits` (so the grid is B x Hkv x row_splits
    programs: whole waves of the SMs, or not), tiles of 16 and 32, 2 to 4 warps, 2 or 3
    stages; each checked against the default launch."""
    from sparseengine.kernels import sparse_page_decode_triton

    args, want, nbytes = _chosen_pages_case(B, P, n, width)
    configs = [dict(), dict(kv_chunk=64, block_n=32, num_warps=4, num_stages=2)]
    for splits in (6, 8, 10, 11, 12, 14, 16, 17, 22, 33):
        for block_n, num_warps, num_stages in ((32, 4, 2), (32, 4, 3), (16, 2, 2), (32, 2, 2)):
            configs.append(dict(row_splits=splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages))
    for kw in configs:
        fn = lambda: sparse_page_decode_triton(*args, **kw)  # noqa: E731
        err = (fn().float() - want).abs().max().item()
        emit(out_path, {"kind": "quest_attention_splits", "batch": B, "hkv": HKV, "pages": width, "kv_len": n,
                        **kw, "us_per_launch": (us := per_launch_us(fn)), "GBps": nbytes / us / 1e3,
                        "max_abs_diff_vs_default": err})


def bench_quest_attention_widths(out_path, B=6, P=8320, n=131072, widths=(1, 4, 16, 64, 129, 256, 512)):
    """Quest's sparse-page attention at its default launch, `widths` chosen pages a (request,
    KV head) at the 128K shape, per launch in a CUDA graph of 30 launches (the merge kernel
    included): how much of a launch is fixed (the lines' intercept) and how much is bytes."""
    from sparseengine.kernels import sparse_page_decode_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k_cache, v_cache, table, kv_lens = _attention_inputs(B, P, n, gen)
    for width in widths:
        chosen = torch.rand(B, HKV, n // PS, generator=gen, device="cuda").argsort(-1)[..., :width]
        pages = chosen.sort(-1).values.contiguous()
        counts = torch.full((B, HKV), width, dtype=torch.int32, device="cuda")
        fn = lambda: sparse_page_decode_triton(q, k_cache, v_cache, table, kv_lens, pages, counts)  # noqa: E731
        us = per_launch_us(fn)
        nbytes = 2 * B * HKV * width * PS * D * 2
        emit(out_path, {"kind": "quest_attention_width", "batch": B, "hkv": HKV, "pages": width, "kv_len": n,
                        "us_per_launch": us, "GBps": nbytes / us / 1e3})


def bench_quest_overlap(out_path, B=6, P=8320, n=131072, layers=30):
    """Quest's sparse layers' attention block (page scores -> selection -> sparse-page
    attention and its merge) for `layers` layers in one CUDA graph, per layer: the whole
    batch on one stream (the engine today) against the batch cut in parts, each part's
    chain on its own stream (fork before, join after each layer), so one part's selection
    (latency-bound: 48 programs at B=6) runs beside another part's scores or attention.
    `serial_parts`: the same parts on one stream, the cost of cutting alone. Each variant's
    outputs are checked bit for bit against the whole batch's (every kernel is per row)."""
    from sparseengine.kernels import quest_page_scores_triton, quest_select_pages_triton, sparse_page_decode_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k_cache, v_cache, table, kv_lens = _attention_inputs(B, P, n, gen)
    kmax = torch.randn(B * P, HKV, D, generator=gen, device="cuda").to(BF16)
    kmin = kmax - torch.rand(B * P, HKV, D, generator=gen, device="cuda").to(BF16)

    def block(rows):
        qs, ts, ls = q[rows], table[rows], kv_lens[rows]
        scores = quest_page_scores_triton(qs, kmax, kmin, ts, ls, PS)
        pages, counts = quest_select_pages_triton(scores, ls, PS, 64, 512, 1472)
        return sparse_page_decode_triton(qs, k_cache, v_cache, ts, ls, pages, counts)

    def parts_of(k):
        edges = [B * i // k for i in range(k + 1)]
        return [slice(a, b) for a, b in zip(edges, edges[1:])]

    def on_streams(parts, streams):
        def run():
            main = torch.cuda.current_stream()
            outs = [None] * len(parts)
            for i, s in enumerate(streams):
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    outs[i + 1] = block(parts[i + 1])
            outs[0] = block(parts[0])
            for s in streams:
                main.wait_stream(s)
            return torch.cat(outs)
        return run

    want = block(slice(0, B))
    variants = {"whole_batch": lambda: block(slice(0, B))}
    for k in (2, 3):
        parts = parts_of(k)
        variants[f"serial_parts_{k}"] = lambda parts=parts: torch.cat([block(p) for p in parts])
        variants[f"streams_{k}"] = on_streams(parts, [torch.cuda.Stream() for _ in range(k - 1)])
        variants[f"streams_{k}_side_high_priority"] = on_streams(
            parts, [torch.cuda.Stream(priority=-1) for _ in range(k - 1)])
    for name, fn in variants.items():
        same = torch.equal(fn(), want)
        torch.cuda.synchronize()
        emit(out_path, {"kind": "quest_overlap", "variant": name, "batch": B, "hkv": HKV, "pages": P, "kv_len": n,
                        "layers": layers, "us_per_layer": per_launch_us(fn, launches=layers),
                        "equals_whole_batch": same})


def bench_quest_select_warps(out_path, B=6, P=8320, n=131072):
    """Quest's page choice as the engine launches it (the group maxima from the page scores'
    launch, scores of random bounds and queries at the 128K shape), per launch in a CUDA
    graph of 30: pages a block x warps, each checked against the default launch."""
    from sparseengine.kernels import quest_scores, quest_select

    q, kmax, kmin, table, kv_lens = _score_inputs(B, P, n)
    sink, recent, budget = 64, 512, 1472
    group = quest_select.maxima_group(P, PS, budget, quest_scores.SCORE_BLOCK_P)
    scores, maxima = quest_scores.quest_page_scores_and_maxima_triton(
        q, kmax, kmin, table, kv_lens, PS, group=group, sink_pages=sink // PS, recent_tokens=recent)
    args = (scores, kv_lens, PS, sink, recent, budget)
    want = quest_select.quest_select_pages_triton(*args, group_maxima=maxima)
    for block_p in (2048, 4096, 8192):
        for warps in (4, 8, 16):
            fn = lambda block_p=block_p, warps=warps: quest_select.quest_select_pages_triton(  # noqa: E731
                *args, group_maxima=maxima, block_p=block_p, num_warps=warps)
            same = all(torch.equal(g, w) for g, w in zip(fn(), want))
            emit(out_path, {"kind": "quest_select_warps", "batch": B, "hkv": HKV, "pages": P, "kv_len": n,
                            "block_p": block_p, "num_warps": warps, "us_per_launch": per_launch_us(fn),
                            "equals_default": same})
