"""Our Triton dense paged decode beside FlashInfer's paged decode on the same cache
(`python -m sparseengine.kernels.bench_gpu --flashinfer`); records a skip when FlashInfer
does not import."""
from __future__ import annotations

import time

import torch

from .bench_common import BF16, D, HKV, HQ, PS, decode_cache, emit, per_launch_us, time_back_to_back, time_cuda
from .paged_decode import paged_decode_ref, paged_decode_triton


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
    ms, mean = time_cuda(run_ours)
    b2b = time_back_to_back(run_ours)
    emit(out_path, {"kind": "bench", "kernel": "paged_decode_triton", "timer": "cuda_events", **shape, "ms": ms,
                     "mean_ms": mean, "GBps": kv_bytes / ms / 1e6, "ms_back_to_back": b2b,
                     "GBps_back_to_back": kv_bytes / b2b / 1e6, **_graph_timed(run_ours, kv_bytes),
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
            ms, mean = time_cuda(lambda: wrapper.run(q, (k_cache, v_cache)))
            b2b = time_back_to_back(lambda: wrapper.run(q, (k_cache, v_cache)))
            emit(out_path, {"kind": "bench", "kernel": "flashinfer_decode", "timer": "cuda_events", **meta, **shape,
                             "ms": ms, "mean_ms": mean, "GBps": kv_bytes / ms / 1e6, "ms_back_to_back": b2b,
                             "GBps_back_to_back": kv_bytes / b2b / 1e6, "plan_ms": plan_ms,
                             **_graph_timed(lambda: wrapper.run(q, (k_cache, v_cache)), kv_bytes),
                             "first_call_s": first_call_s,
                             "max_abs_err_vs_triton": (first.float() - ours.float()).abs().max().item(),
                             "max_abs_err_vs_ref": (first.float() - ref).abs().max().item()})
        except Exception as e:  # noqa: BLE001 - record and go on to the next variant
            emit(out_path, {"kind": "bench", "kernel": "flashinfer_decode", **meta, **shape, "error": repr(e)[:1000]})


def _graph_timed(fn, kv_bytes) -> dict:
    """``ms_graph``: one call among 30 replayed in a CUDA graph, as the engine's decode steps
    run (no host launch time in it, which the events of a single call count); the error
    where the call cannot be captured."""
    try:
        ms = per_launch_us(fn) / 1e3
    except Exception as e:  # noqa: BLE001 - record it beside the other timers
        return {"graph_error": repr(e)[:300]}
    return {"ms_graph": ms, "GBps_graph": kv_bytes / ms / 1e6}
