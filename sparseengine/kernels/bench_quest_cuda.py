"""Quest's CUDA kernels at the 128K decode benchmark's shape beside the launches they replace
(`python -m sparseengine.kernels.bench_gpu --quest-select-cuda | --quest-scores-cuda |
--sparse-attention-cuda --out FILE`): the page choice, the page scores (the two in one launch:
tag quest-pick-experiment), and the attention over Quest's pages and OmniKV's rows.
Each is timed per launch inside a CUDA graph of 30 launches, so launch overhead does not
count; each is checked against the launch it replaces."""
from __future__ import annotations

import torch

from sparseengine.kernels.bench_common import BF16, D, HKV, PS, emit, per_launch_us
from sparseengine.kernels.bench_quest import _score_inputs


def _decode_step_inputs(B, P, n):
    """`_score_inputs` as a decode step's scoring takes them, `((q, kmax, kmin, table, kv_lens,
    page_size), fold)`: each request's newest token at its last page's offset 15, its key (q's
    first Hkv heads) in a cache of B * P pages for the fold (all the fold reads of it)."""
    q, kmax, kmin, table, kv_lens = _score_inputs(B, P, n)
    pages = table[torch.arange(B, device="cuda"), (kv_lens.long() - 1) // PS].long()
    slots = pages * PS + (kv_lens.long() - 1) % PS
    k_cache = torch.zeros(B * P, PS, HKV, D, dtype=BF16, device="cuda")
    k_cache.view(-1, HKV, D)[slots] = q[:, :HKV].clone()
    return (q, kmax, kmin, table, kv_lens, PS), {"k_cache": k_cache, "new_slots": slots}


def bench_quest_select_cuda(out_path, B=6, P=8320, n=131072):
    """Quest's page choice in CUDA (`quest_select_cuda`) beside the Triton launch the engine
    made before it (group maxima from the page scores), per launch in a CUDA graph of 30, on
    the page scores of random bounds and queries at the 128K shape, on random scores, and on
    scores rounded to 1 decimal (ties, counted at the threshold): each checked against the
    Triton kernel's choice; the CUDA launch also as a programmatic dependent launch."""
    from sparseengine.kernels import quest_scores, quest_select, quest_select_cuda

    q, kmax, kmin, table, kv_lens = _score_inputs(B, P, n)
    sink, recent, budget = 64, 512, 1472
    group = quest_select.maxima_group(P, PS, budget, quest_scores.SCORE_BLOCK_P)
    real, maxima = quest_scores.quest_page_scores_and_maxima_triton(
        q, kmax, kmin, table, kv_lens, PS, group=group, sink_pages=sink // PS, recent_tokens=recent)
    gen = torch.Generator(device="cuda").manual_seed(0)
    noise = torch.randn(B, HKV, P, generator=gen, device="cuda")
    for name, scores in (("page_scores", real), ("randn", noise), ("randn_1dp", noise.round(decimals=1))):
        args = (scores, kv_lens, PS, sink, recent, budget)
        want = quest_select.quest_select_pages_triton(*args)
        m = budget // PS
        top = scores[..., sink // PS:(n - recent) // PS].float()
        kth = top.topk(m, dim=-1).values[..., -1:]
        launches = {"triton": lambda: quest_select.quest_select_pages_triton(*args),  # noqa: E731
                    "cuda": lambda: quest_select_cuda.quest_select_pages_cuda(*args, pdl=False),  # noqa: E731
                    "cuda_pdl": lambda: quest_select_cuda.quest_select_pages_cuda(*args, pdl=True)}  # noqa: E731
        if name == "page_scores":
            launches["triton_given_maxima"] = lambda: quest_select.quest_select_pages_triton(  # noqa: E731
                *args, group_maxima=maxima)
        for impl, fn in launches.items():
            same = all(torch.equal(g, w) for g, w in zip(fn(), want))
            emit(out_path, {"kind": "quest_select_cuda", "scores": name, "impl": impl, "batch": B, "hkv": HKV,
                            "pages": P, "kv_len": n, "us_per_launch": per_launch_us(fn), "equals_triton": same,
                            "ties_at_threshold_max": int((top == kth).sum(-1).max())})


def bench_quest_scores_cuda(out_path, B=6, P=8320, n=131072):
    """Quest's page scores in CUDA (`quest_scores_cuda`) beside the Triton launch the engine
    makes, both folding a decode step's keys in (the engine's path), per launch in a CUDA
    graph of 30 on random bounds at the 128K shape: one or two CTAs an SM (or 6 and 24, most
    of them queued, each a shorter run), with and without
    PDL (30 PDL launches in a row let each prefetch its first bounds under the one before:
    the engine's PDL launch follows the qkv linear instead), and the Triton launch with PDL
    (`quest_scores.SCORE_PDL`; also at one tile a program, whose loads go to registers), each
    checked against the Triton kernel's scores (within rounding: the sums run in another
    order)."""
    from sparseengine.kernels import quest_page_scores_triton, quest_scores_cuda
    from sparseengine.kernels.testing import rel_err

    args, fold = _decode_step_inputs(B, P, n)
    want = quest_page_scores_triton(*args, **fold)[..., : n // PS]
    nbytes = 2 * B * (n // PS) * HKV * D * 2
    launches = {"triton": lambda: quest_page_scores_triton(*args, **fold, pdl=False),  # noqa: E731
                "triton_pdl": lambda: quest_page_scores_triton(*args, **fold, pdl=True),  # noqa: E731
                "triton_pdl_1tile": lambda: quest_page_scores_triton(*args, **fold, pdl=True, iters=1)}  # noqa: E731
    for ctas in (1, 2, 6, 24):  # past 2 the CTAs queue, each a shorter run (24: one item each)
        for pdl in (False, True):
            launches[f"cuda_{ctas}cta{'_pdl' if pdl else ''}"] = (
                lambda ctas=ctas, pdl=pdl: quest_scores_cuda.quest_page_scores_cuda(*args, **fold, pdl=pdl,
                                                                                    ctas_per_sm=ctas))
    for prefetch in (0, 128):  # the plain build; one asking L2 for 128 B around each load (the default: 256)
        launches[f"cuda_2cta_pdl_l2_{prefetch}"] = lambda prefetch=prefetch: quest_scores_cuda.quest_page_scores_cuda(
            *args, **fold, pdl=True, l2_prefetch=prefetch)
    for impl, fn in launches.items():
        err = rel_err(fn()[..., : n // PS].float().cpu(), want.float().cpu())
        us = per_launch_us(fn)
        emit(out_path, {"kind": "quest_scores_cuda", "impl": impl, "batch": B, "hkv": HKV, "pages": P, "kv_len": n,
                        "us_per_launch": us, "GBps": nbytes / us / 1e3, "rel_err_vs_triton": err})



def bench_sparse_attention_cuda(out_path, batches=(3, 6), P=8320, n=131072, width=129):
    """The attention over a selection in one CUDA launch (`sparse_attention_cuda`) beside the
    Triton launches it replaces, per launch in a CUDA graph of 30: Quest's 129 chosen pages a
    (request, KV head) at the 128K shape, and OmniKV's shape, the same 2064 tokens as pool
    rows; the CUDA launch at its default split count (4 CTAs a row at these batches), 3, 6 and
    8 (2 cannot take 129 chunks), with its PDL signal, and its builds of 3 and 4 stages. Each
    checked against the Triton launch (max abs difference; the CUDA launch rounds P to bf16
    before P V).
    Repeated launches over the same 24-48 MB find some of it in L2: the decode step's profile
    is the measure that counts."""
    from sparseengine.kernels import sparse_attention_cuda as SA
    from sparseengine.kernels import sparse_page_decode_triton, sparse_rows_decode_triton
    from sparseengine.kernels.bench_quest import _chosen_pages_case

    for B in batches:
        args, want, nbytes = _chosen_pages_case(B, P, n, width)
        q, k_cache, v_cache, table, kv_lens, pages, counts = args
        tokens = (pages[..., None] * PS + torch.arange(PS, device="cuda")).flatten(-2)
        rows = (table.long().gather(1, (tokens // PS).flatten(1)).view_as(tokens) * PS + tokens % PS).int()
        nrows = counts * PS
        launches = {"pages_triton": lambda: sparse_page_decode_triton(*args)}  # noqa: E731
        for splits, trigger, stages in ((None, False, None), (None, True, None), (2, False, None), (3, False, None),
                                        (6, False, None), (8, False, None), (None, False, 3), (None, False, 4)):
            if splits and splits * SA.MAX_CHUNKS_PER_SPLIT < width:
                continue  # too few CTAs for the row's chunks (the wrapper refuses)
            name = f"pages_cuda_s{splits or 'default'}{'_trigger' * trigger}{f'_stages{stages}' * bool(stages)}"
            launches[name] = (lambda splits=splits, trigger=trigger, stages=stages: SA.sparse_page_decode_cuda(
                *args, splits=splits, trigger=trigger, stages=stages))
        launches["rows_triton"] = lambda: sparse_rows_decode_triton(q, k_cache, v_cache, table, kv_lens, rows,  # noqa
                                                                    nrows)
        for stages in (2, 3, 4):
            launches[f"rows_cuda_stages{stages}"] = lambda stages=stages: SA.sparse_rows_decode_cuda(
                q, k_cache, v_cache, rows, nrows, stages=stages)
        for impl, fn in launches.items():
            err = (fn().float() - want).abs().max().item()
            us = per_launch_us(fn)
            emit(out_path, {"kind": "sparse_attention_cuda", "impl": impl, "batch": B, "hkv": HKV, "pages": width,
                            "kv_len": n, "us_per_launch": us, "GBps": nbytes / us / 1e3,
                            "max_abs_diff_vs_triton_pages": err})
