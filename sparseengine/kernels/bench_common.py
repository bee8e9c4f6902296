"""What the GPU benchmarks share: the Llama-3.1-8B attention shape, the JSON-lines writer
with its provenance record, a random dense decode cache, the three device timers (CUDA events
per call, calls back to back, launches replayed in one CUDA graph) and the host's time to
issue a call."""
from __future__ import annotations

import json
import os
import subprocess
import time

import torch

HQ, HKV, D, PS = 32, 8, 128, 16
BF16 = torch.bfloat16


def emit(out_path, record):
    line = json.dumps(record)
    print(line, flush=True)
    with open(out_path, "a") as f:
        f.write(line + "\n")


def run_meta() -> dict:
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


def decode_cache(B, L, gen_seed=0):
    torch.manual_seed(gen_seed)
    pages = L // PS
    k_cache = torch.randn(B * pages, PS, HKV, D, device="cuda", dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randperm(B * pages, device="cuda").int().view(B, pages)
    kv_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, device="cuda", dtype=BF16)
    return q, k_cache, v_cache, page_table, kv_lens


def time_cuda(fn, iters=50, warmup=5):
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


def time_back_to_back(fn, calls: int = 20, iters: int = 10) -> float:
    """Median ms of one ``fn()`` among ``calls`` issued back to back between two events: the
    host queues the next launch while the GPU runs this one, so the host's launch time is
    not counted (a single call's events count the first launch's)."""
    return time_cuda(lambda: [fn() for _ in range(calls)], iters=iters, warmup=1)[0] / calls


def per_launch_us(fn, launches: int = 30) -> float:
    """Median microseconds of one ``fn()`` among ``launches`` replayed in one CUDA graph
    (no launch overhead counted)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    median, _ = time_cuda(graph.replay, iters=20)
    return 1e3 * median / launches


def host_ms(fn, calls: int = 50) -> float:
    """Host milliseconds to issue one ``fn()`` (``calls`` back to back, the device synced
    only before and after: the launch queue does not fill at these sizes)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * elapsed / calls
