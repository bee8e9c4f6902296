"""Probe (GPU): does prefetching a layer's weight into L2 make its skinny GEMM faster when
the weight is read later, after a 50 MB stream (Quest's sparse attention) in between?

    python scripts/probe_l2_prefetch.py OUT.jsonl          # the GEMM alone after each setup (CUDA events)
    python scripts/probe_l2_prefetch.py OUT.jsonl graph    # per rep in CUDA graphs, the prefetch on a side stream

Prefetches: `prefetch.global.L2::evict_last` a line, `cp.async.bulk.prefetch.L2` 16 KB at a
time (with and without an evict_last policy), or plain loads with eviction_policy. Measured
on the H200 (results/tried_not_kept_h200.jsonl, kinds l2_prefetch_*): no gain worth a side
stream in the model (under 1 us a layer), so the model does not prefetch."""
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from sparseengine.kernels.skinny_linear import engine_tiles, skinny_linear_triton


@triton.jit
def prefetch_asm(ptr, n_lines, LINES: tl.constexpr):
    i = tl.program_id(0) * LINES + tl.arange(0, LINES)
    i = tl.minimum(i, n_lines - 1)
    p = ptr + i.to(tl.int64) * 64  # bf16: 64 elements a 128-byte line
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [p],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_bulk(ptr, n_chunks, CHUNKS: tl.constexpr, CHUNK_BYTES: tl.constexpr, LAST: tl.constexpr):
    i = tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)
    i = tl.minimum(i, n_chunks - 1)
    p = ptr + i.to(tl.int64) * (CHUNK_BYTES // 2)
    size = tl.full([CHUNKS], CHUNK_BYTES, tl.int32)
    if LAST:
        tl.inline_asm_elementwise(
            "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; } mov.u32 $0, 0;",
            "=r,l,r", [p, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
                                  "=r,l,r", [p, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_kernel(ptr, dummy, N, BLOCK: tl.constexpr, POLICY: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(ptr + offs, mask=offs < N, other=0.0, eviction_policy=POLICY)
    s = tl.sum(x.to(tl.float32))
    tl.store(dummy + tl.program_id(0), s, mask=s == 123456.75)


def graph_probe(path):
    """In CUDA graphs: per rep, a clean 256 MB read (L2 flush), a 20 us latency-bound
    stand-in (sleep) with or without a prefetch of o's weight on a side stream, a 50 MB
    stream (the sparse decode), then o and gate_up. us per rep."""
    dev = torch.device("cuda")
    w_o = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    w_gu = torch.randn(28672, 4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(6, 4096, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(25 * 1024 * 1024, device=dev, dtype=torch.bfloat16)
    fl = torch.randn(128 * 1024 * 1024, device=dev, dtype=torch.bfloat16)
    dummy = torch.empty(1 << 20, device=dev)
    to, tg = engine_tiles(4096), engine_tiles(28672)
    side = torch.cuda.Stream()

    def load(t, policy):
        load_kernel[(triton.cdiv(t.numel(), 8192),)](t, dummy, t.numel(), BLOCK=8192, POLICY=policy, num_warps=8)

    def bulk(w, chunk=16384):
        n = w.numel() * 2 // chunk
        prefetch_bulk[(triton.cdiv(n, 128),)](w, n, CHUNKS=128, CHUNK_BYTES=chunk, LAST=True, num_warps=4)

    def asm(w):
        lines = w.numel() // 64
        prefetch_asm[(triton.cdiv(lines, 1024),)](w, lines, LINES=1024, num_warps=4)

    variants = {
        "flush only": (None, None, False),
        "flush+sleep+stream default, no gemm": (None, "", False),
        "no prefetch, stream default": (None, "", True),
        "no prefetch, stream evict_first": (None, "evict_first", True),
        "bulk o, stream evict_first": ([lambda: bulk(w_o)], "evict_first", True),
        "bulk o, stream default": ([lambda: bulk(w_o)], "", True),
        "bulk o + gu 16MB, stream evict_first": ([lambda: bulk(w_o), lambda: bulk(w_gu[:2048])], "evict_first", True),
        "asm o, stream evict_first": ([lambda: asm(w_o)], "evict_first", True),
    }
    reps = 20
    out = []
    for name, (pf, policy, gemms) in variants.items():
        def seq():
            for _ in range(reps):
                load(fl, "")
                main = torch.cuda.current_stream()
                if pf:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        for f in pf:
                            f()
                if policy is not None:
                    torch.cuda._sleep(40000)
                    load(kv, policy)
                if pf:
                    main.wait_stream(side)
                if gemms:
                    skinny_linear_triton(x, w_o, **to)
                    skinny_linear_triton(x, w_gu, **tg)
        seq()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            seq()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / reps)
        r = {"probe": "graph", "case": name, "us_per_rep": statistics.median(ts)}
        out.append(r)
        print(json.dumps(r), flush=True)
    with open(path, "a") as fh:
        for r in out:
            fh.write(json.dumps(r) + "\n")


def events_probe(path):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w_o = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    w_gu = torch.randn(28672, 4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(6, 4096, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(25 * 1024 * 1024, device=dev, dtype=torch.bfloat16)  # 50 MB
    flush = torch.empty(1024 * 1024 * 1024 // 4, device=dev, dtype=torch.float32)  # 1 GB
    dummy = torch.empty(1 << 20, device=dev)
    tiles_o, tiles_gu = engine_tiles(4096), engine_tiles(28672)

    def gemm_o():
        return skinny_linear_triton(x, w_o, **tiles_o)

    def gemm_gu():
        return skinny_linear_triton(x, w_gu, **tiles_gu)

    def do_flush():
        flush.add_(1.0)

    def pf_asm(w):
        lines = w.numel() // 64
        prefetch_asm[(triton.cdiv(lines, 1024),)](w, lines, LINES=1024, num_warps=4)

    def pf_bulk(w, last=True, chunk=16384):
        n = w.numel() * 2 // chunk
        prefetch_bulk[(triton.cdiv(n, 128),)](w, n, CHUNKS=128, CHUNK_BYTES=chunk, LAST=last, num_warps=4)

    def pf_load(w, policy="evict_last"):
        n = w.numel()
        load_kernel[(triton.cdiv(n, 8192),)](w, dummy, n, BLOCK=8192, POLICY=policy, num_warps=8)

    def stream(policy):
        n = kv.numel()
        load_kernel[(triton.cdiv(n, 8192),)](kv, dummy, n, BLOCK=8192, POLICY=policy, num_warps=8)

    def sleep():
        torch.cuda._sleep(40000)

    def gu_head():  # the first 16 MB of gate_up
        return w_gu[:2048]

    cases = {
        "cold": [do_flush],
        "hot (same gemm before)": [do_flush, gemm_o],
        "asm prefetch, sleep": [do_flush, lambda: pf_asm(w_o), sleep],
        "bulk prefetch normal, sleep": [do_flush, lambda: pf_bulk(w_o, False), sleep],
        "bulk prefetch evict_last, sleep": [do_flush, lambda: pf_bulk(w_o, True), sleep],
        "load evict_last prefetch": [do_flush, lambda: pf_load(w_o)],
        "load evict_last, stream 50MB evict_first": [do_flush, lambda: pf_load(w_o), lambda: stream("evict_first")],
        "load evict_last, stream 50MB default": [do_flush, lambda: pf_load(w_o), lambda: stream("")],
        "bulk evict_last, sleep, stream evict_first": [do_flush, lambda: pf_bulk(w_o, True), sleep,
                                                        lambda: stream("evict_first")],
        "bulk evict_last, sleep, stream default": [do_flush, lambda: pf_bulk(w_o, True), sleep, lambda: stream("")],
        "bulk evict_last o + 16MB gu, sleep, stream evict_first": [
            do_flush, lambda: pf_bulk(w_o, True), lambda: pf_bulk(gu_head(), True), sleep,
            lambda: stream("evict_first")],
    }
    out = []
    for name, pre in cases.items():
        for target in ("o", "gu") if "gu" in name or name == "cold" else ("o",):
            ts = []
            for _ in range(25):
                for f in pre:
                    f()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                gemm_o() if target == "o" else gemm_gu()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) * 1e3)
            r = {"case": name, "gemm": target, "us_median": statistics.median(ts), "us_min": min(ts)}
            out.append(r)
            print(json.dumps(r), flush=True)
    # the prefetch kernels' own time, and the stream's
    for name, f in (("asm prefetch o", lambda: pf_asm(w_o)), ("bulk prefetch o", lambda: pf_bulk(w_o, True)),
                    ("load prefetch o", lambda: pf_load(w_o)),
                    ("stream 50MB evict_first", lambda: stream("evict_first")),
                    ("stream 50MB default", lambda: stream(""))):
        ts = []
        for _ in range(25):
            do_flush()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        r = {"case": name, "us_median": statistics.median(ts)}
        out.append(r)
        print(json.dumps(r), flush=True)
    with open(path, "w") as fh:
        for r in out:
            fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    (graph_probe if len(sys.argv) > 2 and sys.argv[2] == "graph" else events_probe)(sys.argv[1])
