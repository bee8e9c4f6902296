"""DeltaKV's rebuild at the 128K decode benchmark's shape, on the GPU
(`python -m sparseengine.kernels.bench_gpu --deltakv-rebuild --out FILE`): a layer of one
request and of a batch of 6, 2048 chosen entries each (the benchmark's sink 64, budget
1472, recent 512), the `budget` history tokens rebuilt from an int4 codec of a 128K history
(8 KV heads, head dim 128, rank 256, 4 neighbours) into a bf16 paged cache. The fused
kernel's tile and warps, one launch for the batch against one per request, and the
engine's torch path (the codec's fixed-width decode, RoPE, then the provider's KV write),
each per call in a CUDA graph of 30 calls."""
from __future__ import annotations

import torch

from sparseengine.kernels.bench_gpu import BF16, D, HKV, PS, emit, per_launch_us


def bench_deltakv_rebuild(out_path, n=131072, sink=64, budget=1472, recent=512, rank=256, batch=6):
    from sparseengine.kernels import deltakv_rebuild_ref, deltakv_rebuild_triton, paged_kv_write_triton
    from sparseengine.kernels.deltakv_rebuild import codec_anchors, codec_table
    from sparseengine.methods import deltakv_codec as codec
    from sparseengine.methods.deltakv_store import CodecStore

    gen = torch.Generator(device="cuda").manual_seed(0)
    hist, width = n - sink - recent, sink + budget + recent
    encs, tokens = [], []
    for _ in range(batch):
        store = CodecStore(hist, 10, 4, 4, 2 * HKV * D, rank, BF16, "cuda")
        store.write_random(hist, gen)
        encs.append(store.full())
        tokens.append(torch.sort(torch.randperm(hist, generator=gen, device="cuda")[:width] + sink).values)
    tokens = torch.stack(tokens)
    up = torch.linalg.qr(torch.randn(2 * HKV * D, rank, generator=gen, device="cuda"))[0].T.contiguous()
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    k_cache = torch.zeros(batch * ((width + PS - 1) // PS), PS, HKV, D, dtype=BF16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    at = torch.arange(width, device="cuda")
    slots = torch.stack([torch.where((at >= sink) & (at < sink + budget), b * width + at, -1) for b in range(batch)])
    want = k_cache.clone(), v_cache.clone()
    deltakv_rebuild_ref(encs, up, inv_freq, tokens, slots, *want, sink)
    per_request = budget * (rank // 2 + rank // 32 * 4 + 4 * 2 + 4 * 2 * HKV * D * 2) + 2 * budget * HKV * D * 2
    shape = {"history": hist, "entries": width, "rebuilt": budget, "hkv": HKV, "head_dim": D, "rank": rank,
             "latent_bits": 4, "neighbors": 4}
    up16 = up.half()  # as the engine runs it on a bf16 cache

    def record(path, rows, fn, **kw):
        fn()
        err = max((a[:rows * width // PS].float() - b[:rows * width // PS].float()).abs().max().item()
                  for a, b in zip((k_cache, v_cache), want))
        us = per_launch_us(fn)
        emit(out_path, {"kind": "deltakv_rebuild", "path": path, "batch": rows, **kw, **shape, "us_per_launch": us,
                        "GBps": rows * per_request / us / 1e3, "max_abs_diff_vs_ref": err})

    for block_m, block_r, warps in ((16, 64, 4), (32, 64, 4), (64, 64, 4), (16, 128, 4), (16, 64, 2)):
        record("fused", 1, lambda: deltakv_rebuild_triton(encs[:1], up16, inv_freq, tokens[:1], slots[:1], k_cache,
                                                          v_cache, sink, block_m=block_m, block_r=block_r,
                                                          num_warps=warps, **one),
               block_m=block_m, block_r=block_r, num_warps=warps)
    anchors = codec_anchors(BF16, torch.uint8, "cuda")
    table = codec_table(encs, anchors).cuda()
    one = dict(table=table[:1], anchors=anchors)
    record("fused", batch, lambda: deltakv_rebuild_triton(encs, up16, inv_freq, tokens, slots, k_cache, v_cache,
                                                          sink, table=table, anchors=anchors))
    record("fused, a launch per request", batch, lambda: [
        deltakv_rebuild_triton(encs[b:b + 1], up16, inv_freq, tokens[b:b + 1], slots[b:b + 1], k_cache, v_cache,
                               sink, table=table[b:b + 1], anchors=anchors) for b in range(batch)])

    def torch_path():  # DeltaKV.rebuild + the provider's write, as on a torch provider
        kv = codec.decode_at(encs[0], up, tokens[0] - sink)
        k, v = codec.split_kv(kv, HKV, D)
        paged_kv_write_triton(codec.rotate_keys(k, tokens[0], inv_freq), v, k_cache, v_cache, slots[0])

    record("torch", 1, torch_path)
