"""GPU check and benchmark of the kernels: `python -m sparseengine.kernels.bench_gpu --out FILE`.

1. Checks every Triton kernel against its torch reference at a medium bf16 shape.
2. Times dense paged decode (Llama-3.1-8B attention shape: Hq=32, Hkv=8, d=128, bf16,
   page 16) at batch 32 x 32K and batch 1 x 128K with `triton.testing.do_bench`
   (median), reporting GB/s of K+V read, for several split sizes.
3. Side by side on the same cache (when `flashinfer` imports): our Triton decode and
   FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` (CUDA-core and tensor-core kernels),
   timed with CUDA events, with the max abs error between them and against the fp32
   torch reference. `--flashinfer` runs only this part.
4. Times the sparse decode paths at the headline budget (2048 tokens), the paged prefill
   and the block-sparse prefill, for reference.
Every result is one JSON line appended to `--out` (and printed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import torch

from . import (decode_colsum_ref, decode_colsum_triton, deltakv_rebuild_ref, deltakv_rebuild_triton,
               omnikv_scores_ref, omnikv_scores_triton, paged_decode_ref, paged_decode_triton,
               paged_kv_write_ref, paged_kv_write_triton, paged_prefill_ref, paged_prefill_triton,
               prefill_window_colsum_ref, prefill_window_colsum_triton, quest_page_scores_ref,
               quest_page_scores_triton, sparse_decode_ref, sparse_decode_triton, sparse_page_decode_ref,
               sparse_page_decode_triton, update_page_minmax_ref, update_page_minmax_triton)
from .block_sparse_prefill import block_sparse_prefill_ref, block_sparse_prefill_triton
from .paged_decode import MODE_DENSE, split_k_decode
from .testing import random_paged_kv, randn, rel_err

HQ, HKV, D, PS = 32, 8, 128, 16
BF16 = torch.bfloat16


def emit(out_path, record):
    line = json.dumps(record)
    print(line, flush=True)
    with open(out_path, "a") as f:
        f.write(line + "\n")


def _meta():
    commit = os.environ.get("SPARSEENGINE_GIT_COMMIT", "")  # set by scripts/gpu_session.sh
    if not commit:
        # --dirty: the device tool's copy carries the working tree over a .git that can stay
        # at an older commit (the session's first); its HEAD alone named the wrong commit
        try:
            git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True)
            commit = git.stdout.strip() if git.returncode == 0 else ""
        except OSError:
            commit = ""
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "git_commit": commit or None, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _pairs(a, b):
    return zip(a, b) if isinstance(a, tuple) else [(a, b)]


def check_kernels(out_path):
    """Each Triton kernel against its reference at a medium bf16 shape."""
    from sparseengine.methods.deltakv_store import CodecStore
    gen = torch.Generator().manual_seed(0)
    lens = [4000, 1234, 777, 2048]
    kv = random_paged_kv(lens, HKV, D, PS, generator=gen, dtype=BF16, device="cuda", poison=False)
    B = len(lens)
    q = randn(B, HQ, D, generator=gen, dtype=BF16, device="cuda")
    base = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    idx = torch.stack([torch.stack([torch.randperm(n, generator=gen)[:512] for _ in range(HKV)]) for n in lens])
    idx, num = idx.int().cuda(), torch.full((B, HKV), 512, dtype=torch.int32, device="cuda")
    pidx = torch.stack([torch.stack([torch.randperm(-(-n // PS), generator=gen)[:32] for _ in range(HKV)])
                        for n in lens]).int().cuda()
    pnum = torch.full((B, HKV), 32, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 512, 512 + 64, 512 + 64 + 1, 512 + 64 + 1 + 300], device="cuda").int()
    qp = randn(int(cu[-1]), HQ, D, generator=gen, dtype=BF16, device="cuda")
    hi = torch.zeros(kv.k_cache.shape[0], HKV, D, device="cuda", dtype=BF16)
    lo = hi.clone()
    slots = torch.cat([kv.slots(b) for b in range(B)])
    update_page_minmax_ref(kv.k_cache, slots, hi, lo)
    n = 3000
    qs, ks, vs = (randn(n, h, D, generator=gen, dtype=BF16, device="cuda") for h in (HQ, HKV, HKV))
    bmask = (torch.rand(HQ, -(-n // 128), -(-n // 128), generator=gen) < 0.3).cuda()
    codec = CodecStore(5000, 10, 4, 4, 2 * HKV * D, 256, BF16, "cuda")
    codec.write_random(5000, torch.Generator(device="cuda").manual_seed(0))
    up = randn(256, 2 * HKV * D, generator=gen, device="cuda") / 16
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    tok = torch.randperm(5000, generator=gen)[:1000].cuda() + 4
    tok_slots = torch.randperm(kv.k_cache.shape[0] * PS, generator=gen)[:1000].cuda()

    def rebuild(fn):
        caches = kv.k_cache.clone(), kv.v_cache.clone()
        fn(codec.full(), up, inv_freq, tok, tok_slots, *caches, 4)
        return caches

    def minmax(fn):
        a, b = torch.zeros_like(hi), torch.zeros_like(lo)
        fn(kv.k_cache, slots, a, b)
        return a, b

    def kv_write(fn):
        caches = kv.k_cache.clone(), kv.v_cache.clone()
        new = randn(5, HKV, D, generator=torch.Generator().manual_seed(1), dtype=BF16, device="cuda")
        fn(new, new, *caches, torch.tensor([3, -1, 40, 41, 7], device="cuda"))
        return caches

    cases = {
        "paged_kv_write": (lambda: kv_write(paged_kv_write_ref), lambda: kv_write(paged_kv_write_triton)),
        "paged_decode": (lambda: paged_decode_ref(*base, return_lse=True),
                         lambda: paged_decode_triton(*base, return_lse=True)),
        "paged_prefill": (lambda: paged_prefill_ref(qp, *base[1:], cu, return_lse=True),
                          lambda: paged_prefill_triton(qp, *base[1:], cu, return_lse=True)),
        "sparse_decode": (lambda: sparse_decode_ref(*base, idx, num), lambda: sparse_decode_triton(*base, idx, num)),
        "sparse_page_decode": (lambda: sparse_page_decode_ref(*base, pidx, pnum),
                               lambda: sparse_page_decode_triton(*base, pidx, pnum)),
        "decode_colsum": (lambda: decode_colsum_ref(*base), lambda: decode_colsum_triton(*base)),
        "prefill_window_colsum": (
            lambda: prefill_window_colsum_ref(qp, kv.k_cache, kv.page_table, kv.kv_lens, cu, 32),
            lambda: prefill_window_colsum_triton(qp, kv.k_cache, kv.page_table, kv.kv_lens, cu, 32)),
        "update_page_minmax": (lambda: minmax(update_page_minmax_ref), lambda: minmax(update_page_minmax_triton)),
        "quest_page_scores": (lambda: quest_page_scores_ref(q, hi, lo, kv.page_table, kv.kv_lens, PS),
                              lambda: quest_page_scores_triton(q, hi, lo, kv.page_table, kv.kv_lens, PS)),
        "omnikv_scores_logits": (lambda: omnikv_scores_ref(q, kv.k_cache, kv.page_table, kv.kv_lens),
                                 lambda: omnikv_scores_triton(q, kv.k_cache, kv.page_table, kv.kv_lens)),
        "omnikv_scores_probs": (lambda: omnikv_scores_ref(q, kv.k_cache, kv.page_table, kv.kv_lens, "probs"),
                                lambda: omnikv_scores_triton(q, kv.k_cache, kv.page_table, kv.kv_lens, "probs")),
        "deltakv_rebuild": (lambda: rebuild(deltakv_rebuild_ref), lambda: rebuild(deltakv_rebuild_triton)),
        "block_sparse_prefill": (lambda: block_sparse_prefill_ref(qs, ks, vs, bmask),
                                 lambda: block_sparse_prefill_triton(qs, ks, vs, bmask)),
    }
    ok = True
    for name, (ref_fn, tri_fn) in cases.items():
        try:
            pairs = list(_pairs(tri_fn(), ref_fn()))
            errs = [rel_err(t, r) for t, r in pairs]
            nan = any(bool(t.isnan().any()) for t, _ in pairs)
            passed = max(errs) < 2e-2 and not nan
            emit(out_path, {"kind": "check", "kernel": name, "rel_err": max(errs), "nan": nan, "ok": passed})
        except Exception as e:  # report and go on: one broken kernel must not hide the others
            passed = False
            emit(out_path, {"kind": "check", "kernel": name, "ok": False, "error": repr(e)[:500]})
        ok &= passed
    return ok


def decode_cache(B, L, gen_seed=0):
    torch.manual_seed(gen_seed)
    pages = L // PS
    k_cache = torch.randn(B * pages, PS, HKV, D, device="cuda", dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randperm(B * pages, device="cuda").int().view(B, pages)
    kv_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, device="cuda", dtype=BF16)
    return q, k_cache, v_cache, page_table, kv_lens


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


def _time_cuda(fn, iters=50, warmup=5):
    """(median, mean) ms of `fn` on the GPU, one CUDA event pair per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2], sum(times) / len(times)



def _time_back_to_back(fn, calls: int = 20, iters: int = 10) -> float:
    """Median ms of one ``fn()`` among ``calls`` issued back to back between two events: the
    host queues the next launch while the GPU runs this one, so the host's launch time is
    not counted (a single call's events count the first launch's)."""
    return _time_cuda(lambda: [fn() for _ in range(calls)], iters=iters, warmup=1)[0] / calls


def per_launch_us(fn, launches: int = 30) -> float:
    """Median microseconds of one ``fn()`` among ``launches`` replayed in one CUDA graph
    (no launch overhead counted)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    median, _ = _time_cuda(graph.replay, iters=20)
    return 1e3 * median / launches

def bench_flashinfer_decode(out_path, B, L):
    """Triton dense paged decode vs FlashInfer decode on one cache. Lengths end off the page
    boundary (L - b % PS) so partial last pages are exercised; FlashInfer's page metadata
    comes from the provider's own `paged_metadata`."""
    from sparseengine.attention.flashinfer_provider import FLASHINFER_VERSION, paged_metadata
    from sparseengine.engine.step_context import LayerView

    shape = {"batch": B, "kv_len": L, "hq": HQ, "hkv": HKV, "head_dim": D, "page_size": PS, "dtype": "bfloat16"}
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        emit(out_path, {"kind": "bench", "kernel": "flashinfer_decode", **shape, "skipped": repr(e)[:300]})
        return
    q, k_cache, v_cache, page_table, kv_lens = decode_cache(B, L)
    lens = [L - b % PS for b in range(B)]
    kv_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    kv_bytes = 2 * sum(lens) * HKV * D * k_cache.element_size()
    ref = paged_decode_ref(q, k_cache, v_cache, page_table, kv_lens).float()
    ours = paged_decode_triton(q, k_cache, v_cache, page_table, kv_lens)
    run_ours = lambda: paged_decode_triton(q, k_cache, v_cache, page_table, kv_lens)  # noqa: E731
    ms, mean = _time_cuda(run_ours)
    b2b = _time_back_to_back(run_ours)
    emit(out_path, {"kind": "bench", "kernel": "paged_decode_triton", "timer": "cuda_events", **shape, "ms": ms,
                     "mean_ms": mean, "GBps": kv_bytes / ms / 1e6, "ms_back_to_back": b2b,
                     "GBps_back_to_back": kv_bytes / b2b / 1e6,
                     "max_abs_err_vs_ref": (ours.float() - ref).abs().max().item()})
    view = LayerView(torch.zeros(B, dtype=torch.long, device="cuda"), kv_lens, tuple(lens), page_table)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    for tensor_cores in (False, True):
        meta = {"tensor_cores": tensor_cores, "backend": "fa2", "flashinfer": flashinfer.__version__,
                "flashinfer_written_for": FLASHINFER_VERSION}
        try:
            t0 = time.perf_counter()
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores,
                                                                    backend="fa2")
            indptr, indices, last_page_len = paged_metadata(view, PS)
            wrapper.plan(indptr, indices, last_page_len, HQ, HKV, D, PS, pos_encoding_mode="NONE",
                         q_data_type=BF16, kv_data_type=BF16)
            first = wrapper.run(q, (k_cache, v_cache))  # the first plan + run also builds the JIT module
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(10):
                wrapper.plan(*paged_metadata(view, PS), HQ, HKV, D, PS, pos_encoding_mode="NONE",
                             q_data_type=BF16, kv_data_type=BF16)
            torch.cuda.synchronize()
            plan_ms = (time.perf_counter() - t0) / 10 * 1e3
            ms, mean = _time_cuda(lambda: wrapper.run(q, (k_cache, v_cache)))
            b2b = _time_back_to_back(lambda: wrapper.run(q, (k_cache, v_cache)))
            emit(out_path, {"kind": "bench", "kernel": "flashinfer_decode", "timer": "cuda_events", **meta, **shape,
                             "ms": ms, "mean_ms": mean, "GBps": kv_bytes / ms / 1e6, "ms_back_to_back": b2b,
                             "GBps_back_to_back": kv_bytes / b2b / 1e6, "plan_ms": plan_ms,
                             "first_call_s": first_call_s,
                             "max_abs_err_vs_triton": (first.float() - ours.float()).abs().max().item(),
                             "max_abs_err_vs_ref": (first.float() - ref).abs().max().item()})
        except Exception as e:  # noqa: BLE001 - record and go on to the next variant
            emit(out_path, {"kind": "bench", "kernel": "flashinfer_decode", **meta, **shape, "error": repr(e)[:1000]})


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
                                               max_q_len=chunk), return_mode="median")
    flops = 4 * HQ * D * sum(ctx - chunk + i + 1 for i in range(chunk))
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
    "quest-attention-splits": ("Quest's sparse-page attention: fixed chunks against each row's own splits, by grid size",
                               "bench_quest", ("bench_quest_attention_splits",)),
    "quest-attention-widths": ("Quest's sparse-page attention at 1 to 512 chosen pages: its fixed and per-byte time",
                               "bench_quest", ("bench_quest_attention_widths",)),
    "quest-overlap": ("Quest's attention block (scores, selection, attention) per layer: the whole batch on one "
                      "stream against parts of it on concurrent streams", "bench_quest", ("bench_quest_overlap",)),
    "quest-score-launches": ("Quest's page scores as its decode step launches them: tiles, warps, stages, stores",
                             "bench_quest", ("bench_quest_score_launches",)),
    "quest-select-warps": ("Quest's page choice as the engine launches it: pages a block x warps",
                           "bench_quest", ("bench_quest_select_warps",)),
    "skinny-linear": ("the decode step's weight GEMMs, cuBLAS beside the skinny Triton linear's configurations",
                      "bench_linear", ("bench_skinny_linear",)),
    "pdl-chain": ("the decode step's GEMM chain: cuBLAS, the skinny Triton linear, and both with PDL", "bench_linear",
                  ("bench_pdl_chain",)),
    "omnikv-attention": ("OmniKV's sparse-layer attention: the split planner's launch against fixed chunks",
                         "bench_omnikv", ("bench_omnikv_attention",)),
    "omnikv-attention-cold": ("OmniKV's sparse-layer attention from DRAM: token ids against pool rows",
                              "bench_omnikv", ("bench_omnikv_attention_cold",)),
    "omnikv-filter": ("OmniKV's filter layers: dense attention storing max logits against plain dense",
                      "bench_omnikv", ("bench_omnikv_filter_layer",)),
    "omnikv-select": ("OmniKV's token pick, Triton variants beside the torch path", "bench_omnikv",
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
    emit(args.out, {"kind": "meta", **_meta()})
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
