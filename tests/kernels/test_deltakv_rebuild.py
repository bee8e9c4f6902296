import dataclasses

import pytest
import torch

from sparseengine.kernels import (codec_addresses, deltakv_rebuild_batched_ref, deltakv_rebuild_batched_triton,
                                 deltakv_rebuild_ref, deltakv_rebuild_triton)
from sparseengine.kernels.testing import assert_close, randn
from sparseengine.methods import deltakv_codec as codec


def _codec(n, hkv, d, r, bits, ratio, neighbors, gen, device, dtype=torch.float32):
    """A real encoding of ``n`` random tokens with a random orthonormal Down/Up pair."""
    dim = 2 * hkv * d
    kv = randn(n, dim, generator=gen)
    basis, _ = torch.linalg.qr(torch.randn(dim, r, generator=gen))
    enc = codec.encode(kv, basis, center_ratio=ratio, neighbors=neighbors, latent_bits=bits)
    to = {f: getattr(enc, f).to(device) for f in ("centers", "neighbors", "latents", "scales", "zeros")}
    to["centers"] = to["centers"].to(dtype)
    return codec.DeltaKVEncoded(enc.n, enc.stride, enc.latent_bits, **to), basis.T.contiguous().to(device)


def _entries(enc, sink, count, num_pages, ps, gen, device, skip=0.25):
    """Distinct token positions inside the history, a free slot each, some skipped (-1)."""
    tokens = sink + torch.randperm(enc.n, generator=gen)[:count]
    slots = torch.randperm(num_pages * ps, generator=gen)[:count]
    slots = torch.where(torch.rand(count, generator=gen) < skip, -1, slots)
    return tokens.to(device), slots.to(device)


def _caches(num_pages, ps, hkv, d, device, dtype=torch.float32):
    k = torch.full((num_pages, ps, hkv, d), float("nan"), dtype=dtype, device=device)
    return k, k.clone()


def _inv_freq(d, device):
    return (1.0 / 500000.0 ** (torch.arange(0, d, 2).float() / d)).to(device)


def test_ref_follows_the_codec(gen):
    """The reference writes what the codec decodes with K rotated at each token's position
    (here as the complex multiplication of channel pairs (c, c + d/2) by e^(i pos f_c)), at
    the named slots, and nothing anywhere else."""
    hkv, d, r, sink, ps = 2, 16, 32, 4, 8
    enc, up = _codec(300, hkv, d, r, 4, 0.1, 3, gen, "cpu")
    tokens, slots = _entries(enc, sink, 120, 20, ps, gen, "cpu")
    inv = _inv_freq(d, "cpu")
    k_cache, v_cache = _caches(20, ps, hkv, d, "cpu")
    deltakv_rebuild_ref(enc, up, inv, tokens, slots, k_cache, v_cache, sink)
    keep = slots >= 0
    k, v = codec.split_kv(codec.decode(enc, up, tokens[keep] - sink), hkv, d)
    theta = (tokens[keep].double()[:, None] * inv.double()[None, :])[:, None, :]
    turned = torch.complex(k[..., : d // 2].double(), k[..., d // 2:].double()) * torch.exp(1j * theta)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert_close(flat_k[slots[keep]], torch.cat([turned.real, turned.imag], -1).float(), 1e-4, "k")
    assert_close(flat_v[slots[keep]], v, 1e-6, "v")
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


CASES = [  # n, hkv, d, r, bits, center ratio, neighbours, entries
    (200, 2, 16, 32, 4, 0.1, 4, 70),
    (150, 1, 32, 64, 16, 0.25, 2, 33),
    (90, 3, 8, 32, 4, 0.5, 1, 90),
]


@pytest.mark.parametrize("n,hkv,d,r,bits,ratio,nb,count", CASES)
def test_triton_matches_ref(n, hkv, d, r, bits, ratio, nb, count, gen, device):
    sink, ps, pages = 3, 4, 60
    enc, up = _codec(n, hkv, d, r, bits, ratio, nb, gen, device)
    tokens, slots = _entries(enc, sink, count, pages, ps, gen, device)
    inv = _inv_freq(d, device)
    want, got = _caches(pages, ps, hkv, d, device), _caches(pages, ps, hkv, d, device)
    deltakv_rebuild_ref(enc, up, inv, tokens, slots, *want, sink)
    deltakv_rebuild_triton(enc, up, inv, tokens, slots, *got, sink)
    assert_close(got[0], want[0], 1e-5, "k")
    assert_close(got[1], want[1], 1e-5, "v")


@pytest.mark.parametrize("bits", [4, 16])
def test_float16_product(bits, gen, device):
    """A float16 Up: the product on tensor cores, latents rounded to float16 (10 mantissa
    bits, as TF32); float32 accumulation."""
    hkv, d, sink, ps = 2, 32, 5, 8
    enc, up = _codec(160, hkv, d, 64, bits, 0.1, 4, gen, device)
    tokens, slots = _entries(enc, sink, 50, 12, ps, gen, device)
    inv = _inv_freq(d, device)
    want, got = _caches(12, ps, hkv, d, device), _caches(12, ps, hkv, d, device)
    deltakv_rebuild_ref(enc, up, inv, tokens, slots, *want, sink)
    deltakv_rebuild_triton(enc, up.half(), inv, tokens, slots, *got, sink)
    assert_close(got[0], want[0], 3e-3, "k")
    assert_close(got[1], want[1], 3e-3, "v")


def test_int32_neighbour_indices(gen, device):
    """A history past 32767 centers stores int32 neighbour indices (codec.index_dtype)."""
    hkv, d, sink, ps = 2, 16, 3, 4
    enc, up = _codec(120, hkv, d, 32, 4, 0.1, 3, gen, device)
    enc = dataclasses.replace(enc, neighbors=enc.neighbors.to(torch.int32))
    tokens, slots = _entries(enc, sink, 60, 30, ps, gen, device)
    inv = _inv_freq(d, device)
    want, got = _caches(30, ps, hkv, d, device), _caches(30, ps, hkv, d, device)
    deltakv_rebuild_ref(enc, up, inv, tokens, slots, *want, sink)
    deltakv_rebuild_triton(enc, up, inv, tokens, slots, *got, sink)
    assert_close(got[0], want[0], 1e-5, "k")
    assert_close(got[1], want[1], 1e-5, "v")


def test_all_centers(gen, device):
    """Center ratio 1: every token is raw, the latent buffers are empty."""
    hkv, d, sink, ps = 2, 16, 2, 8
    enc, up = _codec(40, hkv, d, 32, 4, 1.0, 2, gen, device)
    assert enc.latents.shape[0] == 0
    tokens, slots = _entries(enc, sink, 25, 10, ps, gen, device)
    want, got = _caches(10, ps, hkv, d, device), _caches(10, ps, hkv, d, device)
    inv = _inv_freq(d, device)
    deltakv_rebuild_ref(enc, up, inv, tokens, slots, *want, sink)
    deltakv_rebuild_triton(enc, up, inv, tokens, slots, *got, sink)
    assert_close(got[0], want[0], 1e-5, "k")
    assert_close(got[1], want[1], 1e-5, "v")


def test_bad_shapes_raise(gen, device):
    enc, up = _codec(50, 2, 16, 32, 4, 0.1, 2, gen, device)
    tokens, slots = _entries(enc, 0, 10, 10, 8, gen, device)
    k_cache, v_cache = _caches(10, 8, 2, 16, device)
    inv = _inv_freq(16, device)
    with pytest.raises(ValueError, match="do not match the cache"):
        deltakv_rebuild_triton(enc, up[:, :-2], inv, tokens, slots, k_cache, v_cache, 0)
    with pytest.raises(ValueError, match="rank"):
        deltakv_rebuild_triton(enc, up[:16], inv, tokens, slots, k_cache, v_cache, 0)
    with pytest.raises(ValueError, match="same 1-D shape"):
        deltakv_rebuild_triton(enc, up, inv, tokens, slots[:-1], k_cache, v_cache, 0)
    with pytest.raises(ValueError, match="float16 .tensor-core product. or float32"):
        deltakv_rebuild_triton(enc, up.to(torch.bfloat16), inv, tokens, slots, k_cache, v_cache, 0)
    with pytest.raises(ValueError, match="must match"):
        deltakv_rebuild_triton(enc, up, inv, tokens, slots, k_cache, v_cache[:, :4], 0)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 16])
def test_gpu_bf16_cache(bits, gen):
    """The 128K benchmark's shape: 8 KV heads, head dim 128, rank 256, a 2048-entry pick
    at positions up to 128K (float16 product, bf16 cache)."""
    hkv, d, sink, ps, pages = 8, 128, 4, 16, 200
    enc, up = _codec(131072 // 8, hkv, d, 256, bits, 0.1, 4, gen, "cuda", torch.bfloat16)
    tokens = sink + torch.randperm(enc.n, generator=gen)[:2048].cuda() * 8 % enc.n  # wide positions
    slots = torch.randperm(pages * ps, generator=gen)[:2048].cuda()
    inv = _inv_freq(d, "cuda")
    want, got = _caches(pages, ps, hkv, d, "cuda", torch.bfloat16), _caches(pages, ps, hkv, d, "cuda", torch.bfloat16)
    deltakv_rebuild_ref(enc, up, inv, tokens, slots, *want, sink)
    deltakv_rebuild_triton(enc, up.half(), inv, tokens, slots, *got, sink)  # as the engine runs it
    assert_close(got[0], want[0], 2e-2, "k")
    assert_close(got[1], want[1], 2e-2, "v")


def _batch(gen, device, hkv=2, d=16, r=32, bits=4, sink=3, ps=4, pages=80, width=40):
    """Three requests' codecs of different lengths (so at different addresses), a row
    without one (None), each row's own entries over one shared paged cache."""
    encs, ups = zip(*(_codec(n, hkv, d, r, bits, 0.1, 3, gen, device) for n in (120, 200, 90)))
    encs, up = list(encs), ups[0]  # one layer: one Up rebuilds every row
    free = torch.randperm(pages * ps, generator=gen)
    tokens = torch.zeros(4, width, dtype=torch.long)
    slots = torch.full((4, width), -1, dtype=torch.long)
    for b, enc in enumerate(encs + [None]):
        if enc is None:
            continue
        tokens[b] = sink + torch.randint(0, enc.n, (width,), generator=gen)
        take = free[b * width:(b + 1) * width]
        slots[b] = torch.where(torch.rand(width, generator=gen) < 0.2, -1, take)
    encs.insert(3, None)
    return encs, up, tokens.to(device), slots.to(device)


@pytest.mark.parametrize("bits", [4, 16])
def test_batched_matches_ref(bits, gen, device):
    """One launch for four rows (three codecs and a row with none) writes what each row's
    reference rebuild writes, and nothing else."""
    hkv, d, sink, ps, pages = 2, 16, 3, 4, 80
    encs, up, tokens, slots = _batch(gen, device, hkv, d, bits=bits, sink=sink, ps=ps, pages=pages)
    inv = _inv_freq(d, device)
    want, got = _caches(pages, ps, hkv, d, device), _caches(pages, ps, hkv, d, device)
    deltakv_rebuild_batched_ref(encs, up, inv, tokens, slots, *want, sink)
    deltakv_rebuild_batched_triton(encs, up, inv, tokens, slots, *got, sink)
    assert want[0].isnan().any() and not want[0].isnan().all()
    assert_close(got[0], want[0], 1e-5, "k")
    assert_close(got[1], want[1], 1e-5, "v")


def test_batched_reads_the_addresses_at_each_launch(gen, device):
    """The rows' codecs come from the address table's contents at launch (what a captured
    step relies on): swapping two rows' addresses in place rebuilds each row from the
    other's codec."""
    hkv, d, sink, ps, pages = 2, 16, 3, 4, 80
    encs, up, tokens, slots = _batch(gen, device, hkv, d, sink=sink, ps=ps, pages=pages)
    encs, tokens, slots = encs[:2], tokens[:2], slots[:2]
    tokens = tokens.clamp(max=sink + min(e.n for e in encs) - 1)  # positions both codecs hold
    inv = _inv_freq(d, device)
    addresses = torch.tensor([codec_addresses(e) for e in encs], device=device)
    got = _caches(pages, ps, hkv, d, device)
    deltakv_rebuild_batched_triton(encs, up, inv, tokens, slots, *got, sink, addresses=addresses)
    addresses.copy_(addresses.flip(0).clone())
    swapped = _caches(pages, ps, hkv, d, device)
    deltakv_rebuild_batched_triton(encs, up, inv, tokens, slots, *swapped, sink, addresses=addresses)
    want = _caches(pages, ps, hkv, d, device)
    deltakv_rebuild_batched_ref(encs[::-1], up, inv, tokens, slots, *want, sink)
    assert_close(swapped[0], want[0], 1e-5, "k")
    assert_close(swapped[1], want[1], 1e-5, "v")
    assert not torch.equal(got[0].nan_to_num(), swapped[0].nan_to_num())


def test_batched_bad_input_raises(gen, device):
    hkv, d = 2, 16
    encs, up, tokens, slots = _batch(gen, device, hkv, d)
    k_cache, v_cache = _caches(80, 4, hkv, d, device)
    inv = _inv_freq(d, device)
    with pytest.raises(ValueError, match=r"must be one same \[B, K\] shape with B = 3 codecs"):
        deltakv_rebuild_batched_triton(encs[:3], up, inv, tokens, slots, k_cache, v_cache, 3)
    other = dataclasses.replace(encs[1], neighbors=encs[1].neighbors.to(torch.int32))
    with pytest.raises(ValueError, match="codecs differ"):
        deltakv_rebuild_batched_triton([encs[0], other, encs[2], None], up, inv, tokens, slots, k_cache, v_cache, 3)
    with pytest.raises(ValueError, match="addresses must be int64 \\[4, 5\\]"):
        deltakv_rebuild_batched_triton(encs, up, inv, tokens, slots, k_cache, v_cache, 3,
                                       addresses=torch.zeros(4, 5, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="rank"):
        deltakv_rebuild_batched_triton(encs, up[:16], inv, tokens, slots, k_cache, v_cache, 3)


@pytest.mark.gpu
def test_gpu_batched_bf16_cache(gen):
    """The batched launch at the 128K benchmark's widths: three requests' codecs (8 KV heads,
    head dim 128, rank 256, int4), 2048 entries a row, a bf16 cache, float16 product."""
    hkv, d, sink, ps, width = 8, 128, 4, 16, 2048
    encs, up = [], None
    for n in (16384, 12000, 16384):
        enc, basis = _codec(n, hkv, d, 256, 4, 0.1, 4, gen, "cuda", torch.bfloat16)
        encs.append(enc)
        up = basis if up is None else up
    pages = 3 * width // ps
    tokens = torch.stack([sink + torch.randperm(e.n, generator=gen)[:width] for e in encs]).cuda()
    slots = torch.randperm(pages * ps, generator=gen).view(3, width).cuda()
    slots[1, ::3] = -1
    inv = _inv_freq(d, "cuda")
    want = _caches(pages, ps, hkv, d, "cuda", torch.bfloat16)
    got = _caches(pages, ps, hkv, d, "cuda", torch.bfloat16)
    deltakv_rebuild_batched_ref(encs, up, inv, tokens, slots, *want, sink)
    deltakv_rebuild_batched_triton(encs, up.half(), inv, tokens, slots, *got, sink)
    assert_close(got[0], want[0], 2e-2, "k")
    assert_close(got[1], want[1], 2e-2, "v")
