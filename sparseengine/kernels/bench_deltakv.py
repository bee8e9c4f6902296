"""DeltaKV's rebuild at the 128K decode benchmark's shape, on the GPU
(`python -m sparseengine.kernels.bench_gpu --deltakv-rebuild --out FILE`): one request's
layer, 2048 chosen entries (the benchmark's sink 64, budget 1472, recent 512), the
`budget` history tokens rebuilt from an int4 codec of a 128K history (8 KV heads, head dim
128, rank 256, 4 neighbours) into a bf16 paged cache. The fused kernel's tile and warps side by side with the engine's
torch path (the codec's fixed-width decode, RoPE, then the provider's KV write), each per launch in a
CUDA graph of 30 launches."""
from __future__ import annotations

import torch

from sparseengine.kernels.bench_common import BF16, D, HKV, PS, emit, per_launch_us


def bench_deltakv_rebuild(out_path, n=131072, sink=64, budget=1472, recent=512, rank=256):
    from sparseengine.kernels import deltakv_rebuild_ref, deltakv_rebuild_triton, paged_kv_write_triton
    from sparseengine.methods import deltakv_codec as codec
    from sparseengine.methods.deltakv_store import CodecStore

    gen = torch.Generator(device="cuda").manual_seed(0)
    hist = n - sink - recent
    store = CodecStore(hist, 10, 4, 4, 2 * HKV * D, rank, BF16, "cuda")
    store.write_random(hist, gen)
    enc = store.full()
    up = torch.linalg.qr(torch.randn(2 * HKV * D, rank, generator=gen, device="cuda"))[0].T.contiguous()
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    width = sink + budget + recent
    tokens = torch.sort(torch.randperm(hist, generator=gen, device="cuda")[:width] + sink).values
    pages = (width + PS - 1) // PS
    k_cache = torch.zeros(pages, PS, HKV, D, dtype=BF16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(width, device="cuda")
    slots = torch.where((slots >= sink) & (slots < sink + budget), slots, -1)
    want = k_cache.clone(), v_cache.clone()
    deltakv_rebuild_ref(enc, up, inv_freq, tokens, slots, *want, sink)
    bytes_read = budget * (rank // 2 + rank // 32 * 4 + 4 * 2 + 4 * 2 * HKV * D * 2) + 2 * budget * HKV * D * 2
    shape = {"history": hist, "entries": width, "rebuilt": budget, "hkv": HKV, "head_dim": D, "rank": rank,
             "latent_bits": 4, "neighbors": 4}
    up16 = up.half()  # as the engine runs it on a bf16 cache
    for block_m, block_r, warps in ((16, 64, 4), (32, 64, 4), (64, 64, 4), (16, 128, 4), (16, 64, 2), (128, 64, 8)):
        fn = lambda: deltakv_rebuild_triton(enc, up16, inv_freq, tokens, slots, k_cache, v_cache, sink,  # noqa: E731
                                            block_m=block_m, block_r=block_r, num_warps=warps)
        fn()
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip((k_cache, v_cache), want))
        us = per_launch_us(fn)
        emit(out_path, {"kind": "deltakv_rebuild", "path": "fused", "block_m": block_m, "block_r": block_r,
                        "num_warps": warps,
                        **shape, "us_per_launch": us, "GBps": bytes_read / us / 1e3, "max_abs_diff_vs_ref": err})

    def torch_path():  # DeltaKV.rebuild + the provider's write, as on a torch provider
        kv = codec.decode_at(enc, up, tokens - sink)
        k, v = codec.split_kv(kv, HKV, D)
        paged_kv_write_triton(codec.rotate_keys(k, tokens, inv_freq), v, k_cache, v_cache, slots)

    emit(out_path, {"kind": "deltakv_rebuild", "path": "torch", **shape, "us_per_launch": per_launch_us(torch_path)})


def bench_deltakv_rebuild_batched(out_path, batch=6, n=131072, sink=64, budget=1472, recent=512, rank=256):
    """The engine's batched step: ``batch`` requests' layer rebuilt as a launch per request
    (the engine's path before) beside one launch for all (``deltakv_rebuild_batched_triton``,
    its tile and warps), each request with its own codec, entries and scratch slots."""
    from sparseengine.kernels import (codec_addresses, deltakv_rebuild_batched_ref, deltakv_rebuild_batched_triton,
                                      deltakv_rebuild_triton)
    from sparseengine.methods.deltakv_store import CodecStore

    gen = torch.Generator(device="cuda").manual_seed(1)
    hist, width = n - sink - recent, sink + budget + recent
    encs, tokens, slots = [], [], []
    pages_per_row = (width + PS - 1) // PS
    for b in range(batch):
        store = CodecStore(hist, 10, 4, 4, 2 * HKV * D, rank, BF16, "cuda")
        store.write_random(hist, gen)
        encs.append(store.full())
        tokens.append(torch.sort(torch.randperm(hist, generator=gen, device="cuda")[:width] + sink).values)
        slot = b * pages_per_row * PS + torch.arange(width, device="cuda")
        slots.append(torch.where((slot % (pages_per_row * PS) >= sink) & (slot % (pages_per_row * PS) < sink + budget),
                                 slot, -1))
    tokens, slots = torch.stack(tokens), torch.stack(slots)
    up16 = torch.linalg.qr(torch.randn(2 * HKV * D, rank, generator=gen, device="cuda"))[0].T.contiguous().half()
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    k_cache = torch.zeros(batch * pages_per_row, PS, HKV, D, dtype=BF16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    want = k_cache.clone(), v_cache.clone()
    deltakv_rebuild_batched_ref(encs, up16.float(), inv_freq, tokens, slots, *want, sink)
    shape = {"batch": batch, "history": hist, "entries": width, "rebuilt": budget, "hkv": HKV, "head_dim": D,
             "rank": rank, "latent_bits": 4, "neighbors": 4}

    def err():
        return max((a.float() - b.float()).abs().max().item() for a, b in zip((k_cache, v_cache), want))

    def per_request():
        for b in range(batch):
            deltakv_rebuild_triton(encs[b], up16, inv_freq, tokens[b], slots[b], k_cache, v_cache, sink)

    addresses = torch.tensor([codec_addresses(e) for e in encs], dtype=torch.int64, device="cuda")
    for _ in range(2):  # two rounds, alternating
        k_cache.zero_(), v_cache.zero_()
        per_request()
        emit(out_path, {"kind": "deltakv_rebuild_batched", "path": "launch per request", **shape,
                        "us_per_layer": per_launch_us(per_request), "max_abs_diff_vs_ref": err()})
        for block_m, warps, stages, block_r in ((16, 4, 2, 64), (16, 4, 3, 64), (16, 4, 2, 32), (16, 4, 3, 32),
                                                (16, 4, 4, 32), (32, 4, 2, 32), (16, 2, 2, 64)):
            k_cache.zero_(), v_cache.zero_()
            fn = lambda: deltakv_rebuild_batched_triton(  # noqa: E731
                encs, up16, inv_freq, tokens, slots, k_cache, v_cache, sink, addresses=addresses, block_m=block_m,
                num_warps=warps, num_stages=stages, block_r=block_r)
            fn()
            emit(out_path, {"kind": "deltakv_rebuild_batched", "path": "one launch", "block_m": block_m,
                            "num_warps": warps, "num_stages": stages, "block_r": block_r, **shape,
                            "us_per_layer": per_launch_us(fn), "max_abs_diff_vs_ref": err()})
