"""DeltaKV: rebuild chosen history tokens from one layer's codec, straight into the paged cache.

The codec (METHODS.md, deltakv; `methods.deltakv_codec`) is passed as `enc`, anything with
`DeltaKVEncoded`'s fields: `stride`; `centers [C, D]` (raw pre-RoPE `[K | V]`, center i
at codec position `i * stride`); for the j-th non-center token, `neighbors [M, NB]`
(center indices, -1 = none) and its latent, int4 (`latents` uint8 `[M, r/2]`, two codes a
byte, low nibble first; `scales`, `zeros` float16 `[M, r/32]`) or float16 (`latents`
`[M, r]`).

For each entry i with `slots[i] >= 0`, the token at position `tokens[i]` is codec position
`p = tokens[i] - sink`:
- a center (`p % stride == 0`): `kv = centers[p // stride]`;
- otherwise, row `j = p - p // stride - 1`: `kv = z_j @ up + mean of centers[neighbors[j]]`
  (the valid ones), `z_j` dequantized as `code * scale + zero`.
K (columns `[0, Hkv*d)`, head-major) is rotated at `tokens[i]` in the rotate_half
convention, `cos/sin(tokens[i] * inv_freq)` in float32; K and V are written to the NHD
caches at `slot = page * page_size + offset`, cast to the cache dtype. Entries with
`slots[i] < 0` are skipped and read nothing. Nothing is returned; nothing waits on the
device (the caller keeps every written entry's position inside the codec).

`deltakv_rebuild_batched_triton` does the same for a batch of requests in one launch:
`tokens`, `slots` `[B, K]`, row b rebuilt from request b's codec, whose buffers it finds
through `addresses [B, 5]` (int64 device addresses of centers, neighbours, latents, scales,
zeros: `codec_addresses`), so a captured step reads whatever codec each row's table names.
All rows share the dtypes, rank and stride. A row with nothing to rebuild (slots all -1)
may name address 0.

Triton: one program per (tile of BLOCK_M entries, KV head, K or V); the d/2 halves are two
float32 accumulators so RoPE is applied in registers. They take the neighbour mean first and
the product after (so the mean's loads and sums are done before the product's registers are
needed: 72 registers a thread at 16 x 4 warps on sm_90, against 103 summing it apart). The
`z @ up` product runs in `up`'s dtype with float32 accumulation: float16 on tensor cores (the
latents rounded to float16, 10 mantissa bits, as TF32 would), float32 exactly (IEEE).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._common import cdiv, check_launch, lazy_jit, next_pow2

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl

# DeltaKV's batched decode step rebuilds every request's entries of a layer in one launch of
# deltakv_rebuild_batched_triton; False: a launch per request (the engine's path before). Read at
# each step, so a profile can set it (scripts/profile_decode_step.py --kernel-const).
ONE_LAUNCH_PER_LAYER = True
# The launch's tile (entries a program), warps and software-pipeline stages (None: Triton's
# default, 3), where a call names none; read at each launch (a profile's --kernel-const sets
# them). On the H200 at the 128K benchmark's shape (bench_deltakv, session 28): 16 x 4 x 2 stages
# x 64 latents 165 us a layer, 3 stages 184 (34.8 KB of shared memory a program against 17.9),
# 32 latents a step 172-186, 32 x 4 x 2 194-205; session 27's kernel 199 in the same call.
BLOCK_M, NUM_WARPS, NUM_STAGES = 16, 4, 2
BLOCK_R = None  # latents a step of the product loop (None: 64; 32 when the rank is 32 or less)

def deltakv_rebuild_ref(enc, up, inv_freq, tokens, slots, k_cache, v_cache, sink: int) -> None:
    """The codec's own decode (``deltakv_codec.decode_at``, the definition) and RoPE, written
    at the named slots."""
    from sparseengine.methods import deltakv_codec as codec  # late: the codec imports this package

    keep = slots >= 0
    tok, slot = tokens[keep].long(), slots[keep].long()
    k, v = codec.split_kv(codec.decode_at(enc, up, tok - sink), k_cache.shape[2], k_cache.shape[3])
    k = codec.rotate_keys(k, tok, inv_freq)
    ps = k_cache.shape[1]
    k_cache[slot // ps, slot % ps] = k.to(k_cache.dtype)
    v_cache[slot // ps, slot % ps] = v.to(v_cache.dtype)


def deltakv_rebuild_batched_ref(encs, up, inv_freq, tokens, slots, k_cache, v_cache, sink: int) -> None:
    """Row b of ``tokens``/``slots`` ``[B, K]`` rebuilt from ``encs[b]`` (None: nothing to rebuild)."""
    for enc, tok, slot in zip(encs, tokens, slots):
        if enc is not None:
            deltakv_rebuild_ref(enc, up, inv_freq, tok, slot, k_cache, v_cache, sink)


CODEC_FIELDS = ("centers", "neighbors", "latents", "scales", "zeros")


def codec_addresses(enc) -> list[int]:
    """The device addresses ``deltakv_rebuild_batched_triton`` reads a row's codec at. The
    kernel loads through them as 16-byte aligned (wide loads, as a pointer argument's
    specialisation gives): a buffer that is not raises."""
    addresses = [getattr(enc, f).data_ptr() for f in CODEC_FIELDS]
    if any(a % 16 for a in addresses):
        raise ValueError(f"codec buffers must be 16-byte aligned for the batched rebuild: {CODEC_FIELDS} at "
                         f"{[hex(a) for a in addresses]}")
    return addresses


def _check(enc, up, inv_freq, k_cache, v_cache) -> tuple[int, int]:
    """Raise where the codec, ``up`` and the caches do not fit together; ``(bits, group)``."""
    centers, latents = enc.centers, enc.latents
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    width, r = 2 * hkv * d, up.shape[0]
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"k/v caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} must match, head_dim contiguous")
    if d % 2 or up.shape[1] != width or centers.shape[1] != width or inv_freq.numel() != d // 2:
        raise ValueError(f"shapes do not match the cache [*, *, {hkv}, {d}]: up {tuple(up.shape)}, centers "
                         f"{tuple(centers.shape)}, inv_freq {tuple(inv_freq.shape)}")
    bits = 4 if latents.dtype == torch.uint8 else 16
    group = r // max(1, enc.scales.shape[1]) if bits == 4 else r  # int4: one scale and zero per group
    if latents.shape[1] != (r // 2 if bits == 4 else r) or (bits == 4 and group * enc.scales.shape[1] != r):
        raise ValueError(f"latents {tuple(latents.shape)} ({latents.dtype}) and scales {tuple(enc.scales.shape)} "
                         f"do not match up's rank {r}")
    if up.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"up must be float16 (tensor-core product) or float32 (exact product), got {up.dtype}")
    return bits, group


def deltakv_rebuild_triton(enc, up, inv_freq, tokens, slots, k_cache, v_cache, sink: int, *,
                           block_m: int | None = None, block_r: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None) -> None:
    bits, group = _check(enc, up, inv_freq, k_cache, v_cache)
    if tokens.shape != slots.shape or tokens.dim() != 1:
        raise ValueError(f"tokens {tuple(tokens.shape)} and slots {tuple(slots.shape)} must be one same 1-D shape")
    check_launch(tokens, slots, enc.centers, enc.latents, up, inv_freq, k_cache, v_cache)
    if tokens.shape[0] == 0:
        return
    neighbors, latents = enc.neighbors, enc.latents
    if latents.shape[0] == 0:  # every token a center: the latent side is never read
        neighbors = enc.centers.new_full((1, max(1, neighbors.shape[1])), -1, dtype=torch.int32)
        latents = latents.new_zeros((1, latents.shape[1]))
    scales = enc.scales if bits == 4 and enc.scales.shape[0] else latents  # unread for 16-bit latents
    zeros = enc.zeros if bits == 4 and enc.zeros.shape[0] else latents
    _launch((enc.centers, neighbors, latents, scales, zeros), tokens, slots, None, 1, up, inv_freq, k_cache, v_cache,
            sink, enc.stride, bits, group, block_m, block_r, num_warps, num_stages)


def deltakv_rebuild_batched_triton(encs, up, inv_freq, tokens, slots, k_cache, v_cache, sink: int, *,
                                   addresses: torch.Tensor | None = None, block_m: int | None = None,
                                   block_r: int | None = None, num_warps: int | None = None,
                                   num_stages: int | None = None) -> None:
    """One launch for ``B`` requests (module docstring). ``encs[b]`` None: row b rebuilds
    nothing (its slots must be -1). ``addresses`` (``[B, 5]`` int64 on the device,
    ``codec_addresses`` of each row, any row-stride): where a captured step finds the
    codecs; computed from ``encs`` when not given."""
    if tokens.shape != slots.shape or tokens.dim() != 2 or len(encs) != tokens.shape[0]:
        raise ValueError(f"tokens {tuple(tokens.shape)} and slots {tuple(slots.shape)} must be one same [B, K] "
                         f"shape with B = {len(encs)} codecs")
    given = [enc for enc in encs if enc is not None]
    if not given or tokens.shape[1] == 0:
        return
    tokens, slots = tokens.contiguous(), slots.contiguous()  # one row stride for both
    kinds = {(e.stride, e.centers.dtype, e.neighbors.dtype, e.latents.dtype, e.neighbors.shape[1]) for e in given}
    if len(kinds) != 1:
        raise ValueError(f"the rows' codecs differ in (stride, dtypes, neighbours): {sorted(map(str, kinds))}")
    bits, group = 16, 0
    for enc in given:
        bits, group = _check(enc, up, inv_freq, k_cache, v_cache)
    device = check_launch(tokens, slots, up, inv_freq, k_cache, v_cache, *(e.centers for e in given))
    if addresses is None:
        addresses = torch.tensor([codec_addresses(e) if e is not None else [0] * 5 for e in encs],
                                 dtype=torch.int64, device=device)
    if addresses.shape != (len(encs), 5) or addresses.dtype != torch.int64 or addresses.stride(1) != 1:
        raise ValueError(f"addresses must be int64 [{len(encs)}, 5] with unit column stride, got "
                         f"{tuple(addresses.shape)} {addresses.dtype}")
    check_launch(addresses, tokens)
    like = given[0]  # the pointer arguments' dtypes; the kernel reads each row's own addresses
    scales = like.scales if bits == 4 else like.latents
    _launch((like.centers, like.neighbors, like.latents, scales, scales), tokens, slots, addresses, tokens.shape[0],
            up, inv_freq, k_cache, v_cache, sink, like.stride, bits, group, block_m, block_r, num_warps, num_stages)


def _launch(codec_ptrs, tokens, slots, addresses, rows, up, inv_freq, k_cache, v_cache, sink, stride, bits, group,
            block_m, block_r, num_warps, num_stages) -> None:
    centers, neighbors, latents, scales, zeros = codec_ptrs
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    r, n = up.shape[0], tokens.shape[-1]
    block_m = block_m or BLOCK_M
    num_warps = num_warps or NUM_WARPS
    num_stages = NUM_STAGES if num_stages is None else num_stages
    block_r = block_r or BLOCK_R or max(32, min(64, next_pow2(r)))
    tiles = cdiv(n, block_m)
    batched = addresses is not None
    _rebuild_kernel[(rows * tiles, hkv, 2)](
        tokens, slots, centers, neighbors, latents, scales, zeros, up.contiguous(), inv_freq.contiguous(),
        k_cache, v_cache, addresses if batched else tokens, addresses.stride(0) if batched else 0,
        tokens.stride(0) if batched else 0, tiles, n, r, sink, stride,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HKV=hkv, HALF=d // 2, BLOCK_HALF=max(16, next_pow2(d // 2)), NB=neighbors.shape[1], BITS=bits,
        GROUP=group, PAGE_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_R=block_r, BATCHED=batched,
        DOT_PREC="ieee" if up.dtype == torch.float32 else "tf32", num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )


@lazy_jit
def _rebuild_kernel(
    tok_ptr, slot_ptr, centers_ptr, nb_ptr, lat_ptr, scale_ptr, zero_ptr, up_ptr, inv_freq_ptr,
    k_cache_ptr, v_cache_ptr, addr_ptr, stride_addr, stride_row, tiles, N, R, sink, stride_codec,
    stride_cp, stride_co, stride_ch,
    HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BATCHED: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    is_v = tl.program_id(2)
    if BATCHED:  # row b's entries, and its codec's buffers from its addresses
        b = tile // tiles
        tile -= b * tiles
        tok_ptr += b * stride_row
        slot_ptr += b * stride_row
        addr = addr_ptr + b * stride_addr  # 16-byte aligned buffers (checked where the table is made)
        centers_ptr = tl.multiple_of(tl.load(addr).to(tl.pointer_type(centers_ptr.dtype.element_ty)), 16)
        nb_ptr = tl.multiple_of(tl.load(addr + 1).to(tl.pointer_type(nb_ptr.dtype.element_ty)), 16)
        lat_ptr = tl.multiple_of(tl.load(addr + 2).to(tl.pointer_type(lat_ptr.dtype.element_ty)), 16)
        if BITS == 4:
            scale_ptr = tl.multiple_of(tl.load(addr + 3).to(tl.pointer_type(scale_ptr.dtype.element_ty)), 16)
            zero_ptr = tl.multiple_of(tl.load(addr + 4).to(tl.pointer_type(zero_ptr.dtype.element_ty)), 16)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    width = HKV * 4 * HALF
    slot = tl.load(slot_ptr + offs_m, mask=offs_m < N, other=-1).to(tl.int64)
    active = slot >= 0
    if tl.max(active.to(tl.int32), axis=0) == 0:  # a tile of sink / recent entries or a padding row: nothing
        return
    tok = tl.load(tok_ptr + offs_m, mask=active, other=0).to(tl.int64)
    p = tok - sink
    center = p // stride_codec
    is_c = active & (p == center * stride_codec)
    other = active & (p != center * stride_codec)
    row = tl.maximum(p - center - 1, 0)  # read under the mask `other` only
    offs_c = tl.arange(0, BLOCK_HALF)
    c_ok = offs_c < HALF
    lo_cols = is_v * (HKV * 2 * HALF) + kvh * 2 * HALF + offs_c
    hi_cols = lo_cols + HALF
    # the mean of the token's valid neighbour centers first (a center: itself, weight 1, and a
    # product of zeros after: it comes back raw), so that its sums are dead before the product
    # takes its accumulators
    count = tl.zeros([BLOCK_M], tl.float32)
    for j in tl.static_range(NB):
        count += (tl.load(nb_ptr + row * NB + j, mask=other, other=-1) >= 0).to(tl.float32)
    weight = tl.where(is_c, 1.0, 1.0 / tl.maximum(count, 1.0))[:, None]
    acc_lo = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    for j in tl.static_range(NB):
        nid = tl.load(nb_ptr + row * NB + j, mask=other, other=-1).to(tl.int64)
        if j == 0:
            nid = tl.where(is_c, center, nid)
        c_mask = (nid >= 0)[:, None] & c_ok[None, :]
        row_at = centers_ptr + nid[:, None] * width
        acc_lo += tl.load(row_at + lo_cols[None, :], mask=c_mask, other=0.0).to(tl.float32) * weight
        acc_hi += tl.load(row_at + hi_cols[None, :], mask=c_mask, other=0.0).to(tl.float32) * weight
    # + z @ up over the latent dim, z dequantized on the fly
    if BITS == 4:  # a byte holds latents 2b (low nibble) and 2b + 1: two products per tile
        for b0 in range(0, R // 2, BLOCK_R // 2):
            offs_b = b0 + tl.arange(0, BLOCK_R // 2)
            b_ok = offs_b < R // 2
            z_mask = other[:, None] & b_ok[None, :]
            byte = tl.load(lat_ptr + row[:, None] * (R // 2) + offs_b[None, :], mask=z_mask, other=0).to(tl.int32)
            group = row[:, None] * (R // GROUP) + (2 * offs_b[None, :]) // GROUP
            scale = tl.load(scale_ptr + group, mask=z_mask, other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + group, mask=z_mask, other=0.0).to(tl.float32)
            z_even = ((byte & 15).to(tl.float32) * scale + zero).to(up_ptr.dtype.element_ty)
            z_odd = ((byte >> 4).to(tl.float32) * scale + zero).to(up_ptr.dtype.element_ty)
            w_mask = b_ok[:, None] & c_ok[None, :]
            even = up_ptr + (2 * offs_b[:, None]) * width
            odd = even + width
            w = tl.load(even + lo_cols[None, :], mask=w_mask, other=0.0)
            acc_lo += tl.dot(z_even, w, input_precision=DOT_PREC)
            w = tl.load(odd + lo_cols[None, :], mask=w_mask, other=0.0)
            acc_lo += tl.dot(z_odd, w, input_precision=DOT_PREC)
            w = tl.load(even + hi_cols[None, :], mask=w_mask, other=0.0)
            acc_hi += tl.dot(z_even, w, input_precision=DOT_PREC)
            w = tl.load(odd + hi_cols[None, :], mask=w_mask, other=0.0)
            acc_hi += tl.dot(z_odd, w, input_precision=DOT_PREC)
    else:
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            z_mask = other[:, None] & r_ok[None, :]
            z = tl.load(lat_ptr + row[:, None] * R + offs_r[None, :], mask=z_mask, other=0.0)
            z = z.to(up_ptr.dtype.element_ty)
            w_mask = r_ok[:, None] & c_ok[None, :]
            w = tl.load(up_ptr + offs_r[:, None] * width + lo_cols[None, :], mask=w_mask, other=0.0)
            acc_lo += tl.dot(z, w, input_precision=DOT_PREC)
            w = tl.load(up_ptr + offs_r[:, None] * width + hi_cols[None, :], mask=w_mask, other=0.0)
            acc_hi += tl.dot(z, w, input_precision=DOT_PREC)
    # RoPE for K at the token's own position
    freq = tl.load(inv_freq_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    angle = tok.to(tl.float32)[:, None] * freq[None, :]
    rot = (is_v == 0).to(tl.float32)  # 1: K (rotated), 0: V (cos 1, sin 0)
    cos = rot * tl.cos(angle) + (1.0 - rot)
    sin = rot * tl.sin(angle)
    y_lo = acc_lo * cos - acc_hi * sin
    y_hi = acc_hi * cos + acc_lo * sin
    dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_co + kvh * stride_ch
    mask = active[:, None] & c_ok[None, :]
    offs = dst[:, None] + offs_c[None, :]
    k_mask = mask & (is_v == 0)
    v_mask = mask & (is_v != 0)
    tl.store(k_cache_ptr + offs, y_lo.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_cache_ptr + offs + HALF, y_hi.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(v_cache_ptr + offs, y_lo.to(v_cache_ptr.dtype.element_ty), mask=v_mask)
    tl.store(v_cache_ptr + offs + HALF, y_hi.to(v_cache_ptr.dtype.element_ty), mask=v_mask)
