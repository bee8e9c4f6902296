"""OmniKV's token pick at the 128K decode benchmark's shape, the Triton and CUDA picks beside
the torch path (`python -m sparseengine.kernels.bench_gpu --omnikv-select --out FILE`). Each
is timed per launch inside a CUDA graph of 30 launches, so launch overhead does not count,
though each of the torch path's kernels still costs its gap in the graph."""
from __future__ import annotations

import torch

from sparseengine.kernels.bench_common import BF16, D, HKV, HQ, PS, emit, per_launch_us


def bench_omnikv_select(out_path, B=6, L=133120, n=131072, sink=64, budget=1472, recent=512):
    """One filter layer's pick from its per-KV-head max logits `[B, Hkv, L]` (the graph's
    133120-token table): torch (max over heads, masking, top-k, sort) against the Triton
    pick (tokens per program, warps) and the CUDA pick (CTAs a cluster), also from the folded
    scores `[B, 1, L]` the engine's filter layers hand over."""
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
    folded = scores.amax(1, keepdim=True)  # what the filter layer's attention hands over by default
    for kw, given in [(kw, scores) for kw in variants] + [({}, folded)]:
        fn = lambda: omnikv_select_triton(given, kv_lens, sink, budget, recent, **kw)  # noqa: E731
        same = all(torch.equal(g, w) for g, w in zip(fn(), want))
        emit(out_path, {"kind": "omnikv_select", "path": "triton", **shape, **kw, "heads_in": given.shape[1],
                        "us_per_launch": per_launch_us(fn), "equals_torch_path": same})
    from sparseengine.kernels import omnikv_select_cuda as cuda_pick

    table = torch.arange(B * (L // PS), dtype=torch.int32, device="cuda").view(B, -1)
    rows = dict(page_table=table, page_size=PS)  # the pool rows too, as the engine asks
    for cluster, given, kw in ((16, folded, {}), (8, folded, {}), (16, scores, {}), (16, folded, rows)):
        fn = lambda: cuda_pick.omnikv_select_cuda(given, kv_lens, sink, budget, recent, cluster=cluster,  # noqa: E731
                                                  pdl=False, **kw)
        same = all(torch.equal(g, w) for g, w in zip(fn(), want))
        emit(out_path, {"kind": "omnikv_select", "path": "cuda", **shape, "cluster": cluster, "rows": bool(kw),
                        "heads_in": given.shape[1], "us_per_launch": per_launch_us(fn), "equals_torch_path": same})
    fn = lambda: omnikv_select_triton(folded, kv_lens, sink, budget, recent, **rows)  # noqa: E731
    emit(out_path, {"kind": "omnikv_select", "path": "triton", **shape, "rows": True, "heads_in": 1,
                    "us_per_launch": per_launch_us(fn), "equals_torch_path": all(torch.equal(g, w)
                                                                                 for g, w in zip(fn(), want))})


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


def bench_omnikv_attention_cold(out_path, B=6, P=8320, n=131072, sink=64, budget=1472, recent=512, sets=8):
    """OmniKV's sparse-layer attention as the engine meets it: each launch of the graph of
    30 takes the next of `sets` selections over its own page table (as each layer reads its
    own cache), so L2 holds no launch's rows from the one before. The token ids (the page
    table looked up a tile at a time) against the same tokens as pool rows (`MODE_ROWS`,
    `page * 16 + offset`: no page-table load), by launch; beside them Quest's page variant
    over 129 random pages a row, the same way."""
    from sparseengine.kernels import sparse_decode_triton, sparse_page_decode_triton, sparse_rows_decode_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = sets * B * P // 2
    k_cache, v_cache = (torch.randn(pool, PS, HKV, D, generator=gen, device="cuda").to(BF16) for _ in range(2))
    kv_lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, generator=gen, device="cuda").to(BF16)
    cases = []
    for _ in range(sets):
        table = torch.randperm(pool, generator=gen, device="cuda")[:B * P].int().view(B, P)
        middle = torch.rand(B, n - sink - recent, generator=gen, device="cuda").argsort(-1)[:, :budget] + sink
        idx = torch.cat([torch.arange(sink, device="cuda").expand(B, sink), middle.sort(-1).values,
                         torch.arange(n - recent, n, device="cuda").expand(B, recent)], 1).int()
        rows = (table.gather(1, (idx // PS).long()) * PS + idx % PS).int()
        pages = torch.rand(B, HKV, n // PS, generator=gen, device="cuda").argsort(-1)[..., :129].int()
        shared = (B, HKV, idx.shape[1])
        cases.append((table, idx[:, None, :].expand(shared), rows[:, None, :].expand(shared), pages))
    width = cases[0][1].shape[-1]
    counts = torch.full((B, HKV), width, dtype=torch.int32, device="cuda")
    page_counts = torch.full((B, HKV), 129, dtype=torch.int32, device="cuda")
    it = iter(range(1 << 30))

    def case():
        return cases[next(it) % sets]

    def tokens(**kw):
        table, idx, _, _ = case()
        return sparse_decode_triton(q, k_cache, v_cache, table, kv_lens, idx, counts, **kw)

    def rows(**kw):
        table, _, r, _ = case()
        return sparse_rows_decode_triton(q, k_cache, v_cache, table, kv_lens, r, counts, **kw)

    def quest():
        table, _, _, pages = case()
        return sparse_page_decode_triton(q, k_cache, v_cache, table, kv_lens, pages, page_counts)

    table, idx, r, _ = cases[0]
    want = sparse_decode_triton(q, k_cache, v_cache, table, kv_lens, idx, counts).float()
    got = sparse_rows_decode_triton(q, k_cache, v_cache, table, kv_lens, r, counts).float()
    shape = {"batch": B, "hkv": HKV, "tokens": width, "kv_len": n, "sets": sets}
    nbytes = 2 * B * HKV * width * D * 2
    emit(out_path, {"kind": "omnikv_attention_cold", "check_rows_vs_tokens": (got - want).abs().max().item(), **shape})

    def rows_runs(pages_contiguous: bool):
        """The rows of tokens 0..width-1 of each request: runs of 16 (each set's own random
        pages) or one run (pages numbered in order, a set a quarter of the pool further):
        where the bytes are differs, not how many."""
        runs = []
        for i, (table, _, _, _) in enumerate(cases):
            if pages_contiguous:
                table = (torch.arange(B * P, device="cuda").view(B, P) + (i % 4) * B * P).int()
            r = (table[:, :width // PS, None] * PS + torch.arange(PS, device="cuda")).flatten(1).int()
            runs.append((table, r[:, None, :].expand(B, HKV, width)))
        it_runs = iter(range(1 << 30))

        def fn(**kw):
            table, r = runs[next(it_runs) % sets]
            return sparse_rows_decode_triton(q, k_cache, v_cache, table, kv_lens, r, counts, **kw)
        return fn

    variants = [("tokens", {}, tokens), ("rows", {}, rows), ("quest_pages_129", {}, quest),
                ("rows_in_runs_of_16", {}, rows_runs(False)), ("rows_in_one_run", {}, rows_runs(True))]
    for chunk, block_n, stages, warps in ((128, 32, 2, 4), (128, 64, 3, 4), (256, 32, 3, 4), (512, 64, 3, 4),
                                          (256, 64, 4, 4), (256, 64, 3, 8), (128, 16, 3, 2)):
        kw = dict(kv_chunk=chunk, block_n=block_n, num_stages=stages, num_warps=warps)
        variants += [("tokens", kw, tokens), ("rows", kw, rows)]
    for name, kw, fn in variants:
        us = per_launch_us(lambda: fn(**kw))  # noqa: B023
        emit(out_path, {"kind": "omnikv_attention_cold", "path": name, **kw, **shape, "us_per_launch": us,
                        "GBps": (nbytes if name != "quest_pages_129" else 2 * B * HKV * 129 * PS * D * 2) / us / 1e3})


def bench_omnikv_filter_layer(out_path, B=6, P=8320, n=131072, layers=6):
    """OmniKV's filter layers' dense attention, which also stores each token's max logit per
    KV head (`decode_max_logits_triton`), beside the plain dense attention, per launch in
    a CUDA graph of 30 that cycles over `layers` caches (each its own page table over the
    pool, as each layer reads its own cache: no launch finds the one before's rows in L2).
    The store's share: the same launch storing nothing (a one-token-wide logits table) or
    every query head's logits, and other tiles."""
    from sparseengine.kernels.omnikv_scores import decode_max_logits_triton
    from sparseengine.kernels.paged_decode import MODE_DENSE, split_k_decode

    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = []
    for _ in range(layers):
        k, v = (torch.randn(B * P, PS, HKV, D, generator=gen, device="cuda").to(BF16) for _ in range(2))
        caches.append((k, v, torch.randperm(B * P, generator=gen, device="cuda").int().view(B, P)))
    kv_lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, generator=gen, device="cuda").to(BF16)
    width = P * PS
    group_max = torch.empty(B, HKV, width, device="cuda")
    one_wide = torch.empty(B, HKV, 1, device="cuda")
    per_head = torch.empty(B, HQ, width, device="cuda")
    it = iter(range(1 << 30))

    def split(logits=None, group=False, **kw):
        k, v, table = caches[next(it) % layers]
        return split_k_decode(q, k, v, table, kv_lens, mode=MODE_DENSE, capacity=width, logits=logits,
                              logits_group_max=group, **kw)

    def engine(**kw):
        k, v, table = caches[next(it) % layers]
        return decode_max_logits_triton(q, k, v, table, kv_lens, width, fill=False, **kw)

    variants = [("dense", split, {}), ("max_logits_engine", engine, {}),  # folded (FOLD_KV_HEADS)
                ("max_logits_engine_per_head", engine, dict(fold=False)),
                ("max_logits_no_fill", split, dict(logits=group_max, group=True)),
                ("max_logits_store_none", split, dict(logits=one_wide, group=True)),
                ("all_head_logits", split, dict(logits=per_head)),
                ("max_logits_block128", split, dict(logits=group_max, group=True, block_n=128)),
                ("max_logits_block32", split, dict(logits=group_max, group=True, block_n=32)),
                ("max_logits_warps8", split, dict(logits=group_max, group=True, num_warps=8)),
                ("max_logits_stages3", split, dict(logits=group_max, group=True, num_stages=3)),
                ("dense_stages3", split, dict(num_stages=3))]
    # tiles, warps and stages, plain and with the group max (its store's layout change goes
    # through shared memory at every one of these: the sm_90 build of each, session 31)
    for block_n, warps, stages in ((128, 4, 2), (128, 4, 3), (64, 2, 2), (64, 2, 3), (256, 8, 2), (32, 1, 2)):
        tile = dict(block_n=block_n, num_warps=warps, num_stages=stages)
        variants += [("dense", split, tile), ("max_logits_no_fill", split, dict(logits=group_max, group=True, **tile))]
    nbytes = 2 * B * HKV * n * D * 2
    for name, fn, kw in variants:
        us = per_launch_us(lambda: fn(**kw))  # noqa: B023
        emit(out_path, {"kind": "omnikv_filter_layer", "path": name, "batch": B, "kv_len": n, "layers": layers,
                        **{k: v for k, v in kw.items() if k not in ("logits", "group", "fold")},
                        "us_per_launch": us, "GBps": nbytes / us / 1e3})
