"""The split-K decode's split plans side by side on the GPU
(`python -m sparseengine.kernels.bench_gpu --splits --out FILE`): the auto plan, the auto
plan without the finer cut of short rows, each row over its own length, and fixed
2048-token chunks, at long rows (128K, 32K) and at SnapKV's compacted rows (2304 tokens)
in a page table sized for max_model_len, from 1 to 183 requests (and SnapKV's rows at
total 8192, 8448 tokens, at 16-100)."""
from __future__ import annotations

import torch

from sparseengine.kernels.bench_common import BF16, D, HKV, HQ, PS, decode_cache, emit, per_launch_us
from sparseengine.kernels.paged_decode import MODE_DENSE, split_k_decode
from sparseengine.kernels.split_plan import want_splits

# (requests, tokens a row, page-table capacity in tokens)
SHAPES = ((1, 131072, 133120), (6, 131072, 133120), (16, 32768, 32768), (32, 32768, 32768), (1, 2304, 133120),
          (6, 2304, 133120), (16, 2304, 133120), (32, 2304, 133120), (64, 2304, 133120), (183, 2304, 133120),
          (16, 8448, 133120), (32, 8448, 133120), (64, 8448, 133120), (73, 8448, 133120), (100, 8448, 133120),
          (128, 2304, 133120), (256, 2304, 133120), (356, 2304, 133120))


def bench_split_plans(out_path):
    for B, L, capacity in SHAPES:
        bench_decode_splits(out_path, B, L, capacity)


LARGE_SHAPES = ((73, 8448, 133120), (128, 2304, 133120), (183, 2304, 133120), (256, 2304, 133120))


def bench_large_rows(out_path):
    """Rows that fill the GPU on their own (`bench_gpu --splits-large`): where the cost of a
    split grid goes when most rows fill one chunk. One program a row (the plan before
    638b4df), the auto plan, and 2 or 4 splits of which only the first has items (a
    `min_chunk` past every row), merged in the split kernel (that split writes the output)
    or by the merge kernel; the auto plan's splits merged by the merge kernel."""
    big = 1 << 30
    plans = {"one_program": dict(row_splits=1), "auto": {}, "auto_merge_kernel": dict(fused_combine=False),
             "s2_one_active_in_kernel": dict(row_splits=2, min_chunk=big, fused_combine=True),
             "s2_one_active_merge_kernel": dict(row_splits=2, min_chunk=big, fused_combine=False),
             "s4_one_active_in_kernel": dict(row_splits=4, min_chunk=big, fused_combine=True)}
    for B, L, capacity in LARGE_SHAPES:
        bench_decode_splits(out_path, B, L, capacity, plans)


def bench_decode_splits(out_path, B, L, capacity, plans=None):
    """Split plans side by side, per launch in a CUDA graph of 30 (`per_launch_us`; a cache
    under the L2's 60 MB is read from L2 after the first launch): the auto plan (fixed
    chunks for few rows, short rows split finer; one program a row for many rows), the same
    without the finer splits (`fine_splits=0`: the plan before the finer splits),
    each row over its own length in `want_splits` chunks (and 2 or 4 times as many: a grid
    without the fixed plan's empty programs, whose chunks stay short enough to balance), and
    fixed 2048-token chunks.
    `capacity` > L is a page table wider than the rows (a CUDA graph's table sized for
    max_model_len, e.g. SnapKV's compacted rows)."""
    q, k_cache, v_cache, page_table, kv_lens = decode_cache(B, L)
    wide = torch.cat([page_table, page_table[:, :1].expand(-1, capacity // PS - page_table.shape[1])], 1).contiguous()
    kv_bytes = 2 * B * L * HKV * D * k_cache.element_size()
    shape = {"batch": B, "kv_len": L, "capacity": capacity, "hq": HQ, "hkv": HKV, "head_dim": D, "page_size": PS}
    want = want_splits(B * HKV, q.device)
    plans = plans or {"auto": {}, "auto_no_fine": dict(fine_splits=0), "per_row": dict(row_splits=want),
                      "per_row_2x": dict(row_splits=2 * want), "per_row_4x": dict(row_splits=4 * want),
                      "fixed_2048": dict(kv_chunk=2048)}
    _time_plans(out_path, "splits", plans, shape, kv_bytes, (q, k_cache, v_cache, wide, kv_lens), capacity)


def _time_plans(out_path, kind, plans, shape, kv_bytes, inputs, capacity):
    """Each plan's launch (split_k_decode's keyword arguments) over `inputs` (q, caches,
    page table, lengths): its time per launch and its largest difference from fixed
    2048-token chunks merged by the merge kernel, one record each."""
    ref = split_k_decode(*inputs, mode=MODE_DENSE, capacity=capacity, kv_chunk=2048, fused_combine=False)
    for plan, kw in plans.items():
        fn = lambda: split_k_decode(*inputs, mode=MODE_DENSE, capacity=capacity, **kw)  # noqa: E731
        err = (fn().float() - ref.float()).abs().max().item()
        us = per_launch_us(fn)
        emit(out_path, {"kind": kind, "kernel": "split_k_decode", "plan": plan, **kw, **shape, "us": us,
                        "GBps": kv_bytes / us / 1e3, "max_abs_diff_vs_fixed_2048": err})


# (name, row lengths, page-table capacity in tokens): a ragged batch beside the uniform batch
# of the same rows' mean length where that is a shape above
RAGGED_SHAPES = (
    ("b16_one_128k", [131072] + [2304] * 15, 133120),
    ("b32_one_128k", [131072] + [4096] * 31, 133120),
    ("b64_spread_1k_32k", [1024 + (32768 - 1024) * i // 63 for i in range(64)], 133120),
    ("b100_one_128k", [131072] + [1024] * 99, 133120),
    ("b200_two_64k", [65536] * 2 + [2048] * 198, 133120),
    # near-uniform: compacted rows a few hundred decode steps apart (the engine's decode window)
    ("b16_staggered_2304", [2304 + 20 * i for i in range(16)], 133120),
    ("b64_staggered_2304", [2304 + 5 * i for i in range(64)], 133120),
    ("b183_staggered_2304", [2304 + 2 * i for i in range(183)], 133120),
)
UNIFORM_CHECKS = ((16, 2304), (64, 2304), (64, 8448), (73, 8448), (183, 2304), (16, 32768), (6, 131072))


def bench_ragged(out_path):
    """The balanced plan (`bench_gpu --splits-ragged`): ragged batches, and uniform ones
    (the engine's benchmark rows) as a check that it costs nothing there; per launch in a
    CUDA graph, the auto plan (balanced where it cuts rows by their own lengths) beside the
    same plan unbalanced (each row over its own length) and fixed 2048-token chunks."""
    plans = {"auto": {}, "auto_unbalanced": dict(balanced=False), "fixed_2048": dict(kv_chunk=2048)}
    for name, lens, capacity in RAGGED_SHAPES:
        _bench_rows(out_path, name, lens, capacity, plans)
    for B, L in UNIFORM_CHECKS:
        _bench_rows(out_path, f"b{B}_uniform_{L}", [L] * B, 133120, plans)
    _emit_registers(out_path)


TUNE_SHAPES = (("b16_uniform_2304", [2304] * 16), ("b64_uniform_2304", [2304] * 64),
               ("b183_uniform_2304", [2304] * 183), ("b73_uniform_8448", [8448] * 73),
               ("b64_staggered_2304", [2304 + 5 * i for i in range(64)]), ("b16_uniform_32768", [32768] * 16),
               ("b16_one_128k", [131072] + [2304] * 15), ("b100_one_128k", [131072] + [1024] * 99))


def bench_tune_balanced(out_path):
    """`bench_gpu --splits-tune`: the split kernel's launch parameters (tile of tokens,
    warps, pipeline stages) under the auto plan, on short uniform rows (where FlashInfer's
    decode ran 6-16% faster, `decode_ragged_flashinfer_h200.jsonl`), long rows and ragged
    batches, per launch in a CUDA graph."""
    plans = {"auto": {}}
    for block_n, warps, stages in ((32, 4, 2), (128, 4, 2), (64, 2, 2), (64, 8, 2), (64, 4, 3), (64, 4, 4),
                                   (32, 2, 3), (128, 8, 3)):
        plans[f"n{block_n}_w{warps}_s{stages}"] = dict(block_n=block_n, num_warps=warps, num_stages=stages)
    for name, lens in TUNE_SHAPES:
        _bench_rows(out_path, name, lens, 133120, plans)


def _emit_registers(out_path):
    """Registers and spills of each split-kernel build the runs compiled."""
    from sparseengine.kernels.paged_decode import _decode_split_kernel

    for cache in _decode_split_kernel._jitted.device_caches.values():
        for key, kernel in cache[0].items():
            emit(out_path, {"kind": "registers", "kernel": "_decode_split_kernel",
                            "n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None),
                            "num_warps": kernel.metadata.num_warps,
                            "key": str(key)[-400:]})


def ragged_inputs(lens, capacity):
    """(q, k_cache, v_cache, page table, kv_lens) of rows `lens` tokens long, in a page table
    `capacity` tokens wide, their pages scattered over a cache just large enough."""
    torch.manual_seed(0)
    B, pages = len(lens), [-(-n // PS) for n in lens]
    k_cache = torch.randn(sum(pages), PS, HKV, D, device="cuda", dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(sum(pages), device="cuda").int()
    table = torch.zeros(B, capacity // PS, dtype=torch.int32, device="cuda")
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[at:at + n]
        at += n
    kv_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, device="cuda", dtype=BF16)
    return q, k_cache, v_cache, table, kv_lens


def _bench_rows(out_path, name, lens, capacity, plans):
    inputs = ragged_inputs(lens, capacity)
    kv_bytes = 2 * sum(lens) * HKV * D * inputs[1].element_size()
    shape = {"shape": name, "batch": len(lens), "tokens": sum(lens), "max_len": max(lens), "capacity": capacity}
    _time_plans(out_path, "splits_ragged", plans, shape, kv_bytes, inputs, capacity)


def bench_ragged_flashinfer(out_path):
    """`bench_gpu --splits-ragged-flashinfer`: the ragged and uniform rows of `bench_ragged`
    through our dense decode (the auto plan, and the same unbalanced) beside FlashInfer's
    batch decode (its own host-side plan, `fa2`, tensor cores as the provider picks them at
    GQA 4), each per launch in a CUDA graph of 30 (FlashInfer's wrapper built with
    `use_cuda_graph=True`, planned once for the shape)."""
    from sparseengine.attention.flashinfer_provider import decode_uses_tensor_cores, paged_metadata
    from sparseengine.engine.step_context import LayerView
    from sparseengine.kernels.paged_decode import paged_decode_ref, paged_decode_triton

    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        emit(out_path, {"kind": "ragged_flashinfer", "skipped": repr(e)[:300]})
        return
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    shapes = list(RAGGED_SHAPES) + [(f"b{B}_uniform_{L}", [L] * B, 133120) for B, L in UNIFORM_CHECKS]
    for name, lens, capacity in shapes:
        q, k_cache, v_cache, table, kv_lens = ragged_inputs(lens, capacity)
        kv_bytes = 2 * sum(lens) * HKV * D * k_cache.element_size()
        shape = {"shape": name, "batch": len(lens), "tokens": sum(lens), "max_len": max(lens), "capacity": capacity}
        ref = paged_decode_ref(q[:1], k_cache, v_cache, table[:1], kv_lens[:1]).float()  # the longest row (row 0)
        runs = {"ours_auto": lambda: paged_decode_triton(q, k_cache, v_cache, table, kv_lens),
                "ours_unbalanced": lambda: paged_decode_triton(q, k_cache, v_cache, table, kv_lens, balanced=False)}
        try:
            indptr, indices, last = paged_metadata(LayerView(torch.zeros_like(kv_lens).long(), kv_lens, tuple(lens),
                                                             table), PS)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=decode_uses_tensor_cores(HQ, HKV),
                paged_kv_indptr_buffer=indptr.cuda(), paged_kv_indices_buffer=indices.clone(),
                paged_kv_last_page_len_buffer=last.cuda(), backend="fa2")
            wrapper.plan(indptr, indices, last, HQ, HKV, D, PS, pos_encoding_mode="NONE", q_data_type=BF16,
                         kv_data_type=BF16)
            runs["flashinfer"] = lambda: wrapper.run(q, (k_cache, v_cache))
        except Exception as e:  # noqa: BLE001 - record it and time ours anyway
            emit(out_path, {"kind": "ragged_flashinfer", "impl": "flashinfer", **shape, "error": repr(e)[:1000]})
        for impl, fn in runs.items():
            try:
                err = (fn()[:1].float() - ref).abs().max().item()
                us = per_launch_us(fn)
                emit(out_path, {"kind": "ragged_flashinfer", "impl": impl, **shape, "us": us,
                                "GBps": kv_bytes / us / 1e3, "max_abs_err_row0_vs_ref": err})
            except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
                emit(out_path, {"kind": "ragged_flashinfer", "impl": impl, **shape, "error": repr(e)[:1000]})
        del q, k_cache, v_cache, table, kv_lens
        torch.cuda.empty_cache()
