"""GPU check and benchmark of the kernels: `python -m sparseengine.kernels.bench_gpu --out FILE`.

1. Checks every Triton kernel against its torch reference at a medium bf16 shape
   (`check_gpu`).
2. Times dense paged decode (Llama-3.1-8B attention shape: Hq=32, Hkv=8, d=128, bf16,
   page 16) at batch 32 x 32K and batch 1 x 128K with `triton.testing.do_bench`
   (median), reporting GB/s of K+V read, for several split sizes.
3. Side by side on the same cache (when `flashinfer` imports): our Triton decode and
   FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` (CUDA-core and tensor-core kernels),
   timed with CUDA events, with the max abs error between them and against the fp32
   torch reference (`bench_flashinfer`). `--flashinfer` runs only this part.
4. Times the sparse decode paths at the headline budget (2048 tokens), the paged prefill
   and the block-sparse prefill, for reference.
Every result is one JSON line appended to `--out` (and printed).
"""
from __future__ import annotations

import argparse

import torch

from . import (decode_colsum_triton, omnikv_scores_triton, paged_decode_triton, paged_prefill_triton,
               quest_page_scores_triton, sparse_decode_triton, sparse_page_decode_triton)
from .bench_common import BF16, D, HKV, HQ, PS, decode_cache, emit, run_meta
from .bench_flashinfer import bench_flashinfer_decode
from .bench_prefill import causal_flops
from .block_sparse_prefill import block_sparse_prefill_triton
from .check_gpu import check_kernels
from .paged_decode import MODE_DENSE, split_k_decode
from .testing import random_paged_kv


def bench_decode(out_path, B, L, chunks=(None, 512, 1024, 2048, 4096, 8192), tune=False):
    from triton.testing import do_bench

    q, k_cache, v_cache, page_table, kv_lens = decode_cache(B, L)
    kv_bytes = 2 * B * L * HKV * D * k_cache.element_size()
    shape = {"batch": B, "kv_len": L, "hq": HQ, "hkv": HKV, "head_dim": D, "page_size": PS, "dtype": "bfloat16"}
    for chunk in chunks:
        ms = do_bench(lambda: paged_decode_triton(q, k_cache, v_cache, page_table, kv_lens, kv_chunk=chunk),
                      return_mode="median")
        emit(out_path, {"kind": "bench", "kernel": "paged_decode_triton", "kv_chunk": chunk or "auto", **shape,
                         "ms": ms, "GBps": kv_bytes / ms / 1e6})
    if tune:  # launch parameters of the split kernel, at two chunk sizes
        for chunk in (None, 1024):
            for block_n, warps, stages in [(bn, nw, ns) for bn in (32, 64, 128) for nw in (4, 8) for ns in (2, 3)]:
                fn = lambda: split_k_decode(q, k_cache, v_cache, page_table, kv_lens, mode=MODE_DENSE,  # noqa: E731
                                            capacity=L, kv_chunk=chunk, block_n=block_n, num_warps=warps,
                                            num_stages=stages)
                ms = do_bench(fn, return_mode="median")
                emit(out_path, {"kind": "tune", "kernel": "paged_decode_triton", "kv_chunk": chunk or "auto",
                                 "block_n": block_n, "num_warps": warps, "num_stages": stages, **shape, "ms": ms,
                                 "GBps": kv_bytes / ms / 1e6})


def bench_sparse(out_path, B=32, L=32768, budget=2048):
    from triton.testing import do_bench

    q, k_cache, v_cache, page_table, kv_lens = decode_cache(B, L)
    idx = torch.stack([torch.randperm(L, device="cuda")[:budget] for _ in range(B * HKV)]).int().view(B, HKV, budget)
    num = torch.full((B, HKV), budget, dtype=torch.int32, device="cuda")
    pidx = (idx[..., : budget // PS] // PS).contiguous()
    npg = torch.full((B, HKV), budget // PS, dtype=torch.int32, device="cuda")
    hi = torch.randn(k_cache.shape[0], HKV, D, device="cuda", dtype=BF16)
    base = (q, k_cache, v_cache, page_table, kv_lens)
    bytes_sel = 2 * B * HKV * budget * D * 2
    runs = {
        "sparse_decode_triton": (lambda: sparse_decode_triton(*base, idx, num), bytes_sel),
        "sparse_page_decode_triton": (lambda: sparse_page_decode_triton(*base, pidx, npg), bytes_sel),
        "quest_page_scores_triton": (lambda: quest_page_scores_triton(q, hi, hi, page_table, kv_lens, PS),
                                     2 * B * (L // PS) * HKV * D * 2),
        "omnikv_scores_triton": (lambda: omnikv_scores_triton(q, k_cache, page_table, kv_lens), B * L * HKV * D * 2),
        "decode_colsum_triton": (lambda: decode_colsum_triton(*base, max_kv_len=L), 2 * B * L * HKV * D * 2),
    }
    for name, (fn, nbytes) in runs.items():
        ms = do_bench(fn, return_mode="median")
        emit(out_path, {"kind": "bench", "kernel": name, "batch": B, "kv_len": L, "budget": budget, "ms": ms,
                         "GBps": nbytes / ms / 1e6})


def bench_prefill(out_path, ctx=32768, chunk=4096, n=16384):
    """Paged chunked prefill (last chunk of a 32K prompt) and block-sparse prefill, TFLOP/s."""
    from triton.testing import do_bench

    torch.manual_seed(0)
    kv = random_paged_kv([ctx], HKV, D, PS, generator=torch.Generator().manual_seed(0), dtype=BF16,
                         device="cuda", poison=False)
    q = torch.randn(chunk, HQ, D, device="cuda", dtype=BF16)
    cu = torch.tensor([0, chunk], device="cuda", dtype=torch.int32)
    ms = do_bench(lambda: paged_prefill_triton(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu,
                                               max_q_len=chunk, min_q_len=chunk), return_mode="median")
    flops = causal_flops(ctx, chunk)
    emit(out_path, {"kind": "bench", "kernel": "paged_prefill_triton", "kv_len": ctx, "q_len": chunk, "ms": ms,
                     "TFLOPs": flops / ms / 1e9})
    qs, ks, vs = (torch.randn(n, h, D, device="cuda", dtype=BF16) for h in (HQ, HKV, HKV))
    nb = -(-n // 128)
    for density in (1.0, 0.3):
        mask = torch.rand(HQ, nb, nb, device="cuda") < density
        ms = do_bench(lambda: block_sparse_prefill_triton(qs, ks, vs, mask), return_mode="median")
        kept = (mask | torch.eye(nb, dtype=torch.bool, device="cuda")).tril().sum().item()
        emit(out_path, {"kind": "bench", "kernel": "block_sparse_prefill_triton", "n": n, "density": density,
                         "ms": ms, "dense_equiv_TFLOPs": 4 * HQ * D * n * n / 2 / ms / 1e9,
                         "block_fraction": kept / (HQ * nb * (nb + 1) / 2)})


# --flag: (help, module of sparseengine.kernels, its functions run in turn with the output path)
PARTS = {
    "splits": ("the decode split strategies side by side (per-row vs fixed chunks)", "bench_splits",
               ("bench_split_plans",)),
    "splits-large": ("the split plans of rows that fill the GPU (short rows in split grids)", "bench_splits",
                     ("bench_large_rows",)),
    "splits-ragged": ("the balanced plan against the per-row one, ragged and uniform batches", "bench_splits",
                      ("bench_ragged",)),
    "splits-tune": ("the split kernel's launch parameters on short, long and ragged rows", "bench_splits",
                    ("bench_tune_balanced",)),
    "splits-ragged-flashinfer": ("our dense decode beside FlashInfer's on the ragged and uniform batches",
                                 "bench_splits", ("bench_ragged_flashinfer",)),
    "deltakv-rebuild": ("DeltaKV's fused rebuild (tiles, warps) beside its torch path", "bench_deltakv",
                        ("bench_deltakv_rebuild",)),
    "deltakv-rebuild-batched": ("DeltaKV's rebuild of a batch's layer: a launch per request against one launch",
                                "bench_deltakv", ("bench_deltakv_rebuild_batched",)),
    "quest-select": ("Quest's page selection, page score and sparse-page attention variants side by side",
                     "bench_quest", ("bench_quest_select", "bench_quest_scores", "bench_quest_attention")),
    "quest-attention-splits": ("Quest's sparse-page attention: fixed chunks against each row's own splits, "
                               "by grid size",
                               "bench_quest", ("bench_quest_attention_splits",)),
    "quest-attention-widths": ("Quest's sparse-page attention at 1 to 512 chosen pages: its fixed and per-byte time",
                               "bench_quest", ("bench_quest_attention_widths",)),
    "quest-overlap": ("Quest's attention block (scores, selection, attention) per layer: the whole batch on one "
                      "stream against parts of it on concurrent streams", "bench_quest", ("bench_quest_overlap",)),
    "quest-score-launches": ("Quest's page scores as its decode step launches them: tiles, warps, stages, stores",
                             "bench_quest", ("bench_quest_score_launches",)),
    "quest-select-warps": ("Quest's page choice as the engine launches it: pages a block x warps",
                           "bench_quest", ("bench_quest_select_warps",)),
    "quest-select-cuda": ("Quest's page choice in CUDA beside the Triton launch", "bench_quest_cuda",
                          ("bench_quest_select_cuda",)),
    "sparse-attention-cuda": ("the attention over Quest's pages and OmniKV's rows in one CUDA launch beside the "
                              "Triton launches", "bench_quest_cuda", ("bench_sparse_attention_cuda",)),
    "quest-scores-cuda": ("Quest's page scores in CUDA beside the Triton launch, the step's keys folded in",
                          "bench_quest_cuda", ("bench_quest_scores_cuda",)),
    "prefill-launches": ("the chunked prefill's launches (tile rows, key block, warps, stages, unmasked blocks "
                         "first) at 32K and 128K", "bench_prefill", ("bench_prefill_launches",)),
    "mixed-steps": ("a mixed step's attention (decode rows beside a prefill chunk) with the decode rows routed "
                    "to the split-K decode and not", "bench_prefill", ("bench_mixed_steps",)),
    "mixed-steps-flashinfer": ("the same through the FlashInfer provider (decode rows out of its prefill, or "
                               "not)", "bench_prefill", ("bench_mixed_steps_flashinfer",)),
    "partly-dense-decode": ("a decode step whose rows are partly dense: each kernel over its own rows against "
                            "both over every row", "bench_prefill", ("bench_partly_dense_decode",)),
    "skinny-linear": ("the decode step's weight GEMMs, cuBLAS beside the skinny Triton linear's configurations",
                      "bench_linear", ("bench_skinny_linear",)),
    "cuda-linear": ("the decode step's linears in CUDA (cuda_linear) beside the Triton kernel, per launch and "
                    "in model order", "bench_cuda_linear", ("bench_cuda_linear",)),
    "pdl-chain": ("the decode step's GEMM chain: cuBLAS, the skinny Triton linear, and both with PDL", "bench_linear",
                  ("bench_pdl_chain",)),
    "omnikv-attention": ("OmniKV's sparse-layer attention: the split planner's launch against fixed chunks",
                         "bench_omnikv", ("bench_omnikv_attention",)),
    "omnikv-attention-cold": ("OmniKV's sparse-layer attention from DRAM: token ids against pool rows",
                              "bench_omnikv", ("bench_omnikv_attention_cold",)),
    "omnikv-filter": ("OmniKV's filter layers: dense attention storing max logits against plain dense",
                      "bench_omnikv", ("bench_omnikv_filter_layer",)),
    "omnikv-select": ("OmniKV's token pick, Triton and CUDA variants beside the torch path", "bench_omnikv",
                      ("bench_omnikv_select", "bench_pick_at_quest_shape")),
}


def main(argv=None):
    import importlib

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON-lines file to append results to")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--tune", action="store_true", help="also sweep the decode kernel's launch parameters")
    parser.add_argument("--flashinfer", action="store_true",
                        help="run only the Triton vs FlashInfer decode side by side")
    for flag, (text, _, _) in PARTS.items():
        parser.add_argument(f"--{flag}", action="store_true", help=f"run only {text}")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU")
    emit(args.out, {"kind": "meta", **run_meta()})
    parts = [part for flag, part in PARTS.items() if getattr(args, flag.replace("-", "_"))]
    for _, module, functions in parts:  # every part named, in PARTS' order
        bench = importlib.import_module(f"sparseengine.kernels.{module}")
        for name in functions:
            getattr(bench, name)(args.out)
    if parts:
        return
    if args.flashinfer:
        bench_flashinfer_decode(args.out, 32, 32768)
        bench_flashinfer_decode(args.out, 1, 131072)
        return
    if not args.skip_check:
        check_kernels(args.out)
    bench_decode(args.out, 32, 32768, tune=args.tune)
    bench_decode(args.out, 1, 131072, tune=args.tune)
    bench_flashinfer_decode(args.out, 32, 32768)
    bench_flashinfer_decode(args.out, 1, 131072)
    bench_sparse(args.out)
    bench_prefill(args.out)


if __name__ == "__main__":
    main()
