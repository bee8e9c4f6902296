"""DeltaKV codec against METHODS.md: centers, neighbours, residual coding, the error
bound derived in the module docstring, byte accounting, checkpoints."""

import math

import pytest
import torch

from sparseengine.methods import deltakv_bytes, deltakv_fit
from sparseengine.methods import deltakv_codec as dk


def rand(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def clustered_kv(n, dim, seed):
    """Tokens scattered around a few anchors, so residuals are small and low-rank-ish."""
    anchors = rand(4, dim, seed=seed) * 3
    pick = torch.arange(n) % 4
    return anchors[pick] + 0.3 * rand(n, dim, seed=seed + 1) + rand(n, 1, seed=seed + 2) * rand(1, dim, seed=seed + 3)


def ref_residuals(kv, ratio, neighbors):
    """Plain loops: centers every round(1/ratio) tokens from 0; K nearest earlier centers."""
    stride = math.floor(1 / ratio + 0.5)
    centers = list(range(0, kv.shape[0], stride))
    res, idx = [], []
    for t in range(kv.shape[0]):
        if t % stride == 0:
            continue
        x = kv[t].double()
        cand = [(float((x - kv[c].double()).norm()), i) for i, c in enumerate(centers) if c < t]
        near = [i for _, i in sorted(cand)[:neighbors]]
        mean = sum(kv[centers[i]].double() for i in near) / len(near)
        res.append(x - mean)
        idx.append(near + [-1] * (neighbors - len(near)))
    return torch.stack(res), idx


def dropped_energy(res, r):
    s = torch.linalg.svdvals(res.double())
    return float((s[r:] ** 2).sum())


# ------------------------------------------------------------------- centers/neighbours


def test_center_stride():
    assert [dk.center_stride(x) for x in (0.1, 0.25, 0.3, 1.0, 0.4)] == [10, 4, 3, 1, 3]
    for bad in (0, -0.1, 1.5, "0.1", True):
        with pytest.raises(ValueError, match="deltakv_center_ratio"):
            dk.center_stride(bad)


@pytest.mark.parametrize("n,ratio,neighbors", [(53, 0.2, 3), (40, 0.1, 1), (31, 0.5, 4), (12, 0.25, 8)])
def test_residuals_match_reference(n, ratio, neighbors):
    kv = rand(n, 24, seed=n)
    res, idx = dk.residuals(kv, ratio, neighbors)
    want_res, want_idx = ref_residuals(kv, ratio, neighbors)
    assert idx.tolist() == want_idx
    torch.testing.assert_close(res.double(), want_res, rtol=1e-5, atol=1e-5)


def test_concat_split_round_trip():
    k, v = rand(7, 2, 4, seed=1), rand(7, 2, 4, seed=2)
    kv = dk.concat_kv(k, v)
    assert kv.shape == (7, 16) and torch.equal(kv[:, :8], k.reshape(7, 8))
    k2, v2 = dk.split_kv(kv, 2, 4)
    assert torch.equal(k, k2) and torch.equal(v, v2)


# ----------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [16, 4])
def test_centers_decode_exactly(dtype, bits):
    kv = clustered_kv(70, 64, seed=3).to(dtype)
    down, up = deltakv_fit.fit_down_up(dk.residuals(kv, 0.1, 2)[0], 32)
    enc = dk.encode(kv, down, center_ratio=0.1, neighbors=2, latent_bits=bits)
    centers = torch.arange(0, 70, 10)
    assert torch.equal(dk.decode(enc, up, centers), kv[centers].float())
    assert enc.centers.dtype == dtype


def test_full_rank_16bit_round_trip_is_exact_to_float16():
    kv = clustered_kv(90, 48, seed=4)
    res, _ = dk.residuals(kv, 0.1, 3)
    down, up = deltakv_fit.fit_down_up(res, 48)
    enc = dk.encode(kv, down, center_ratio=0.1, neighbors=3, latent_bits=16)
    out = dk.decode(enc, up)
    z = res @ down
    # ||error||_F <= ||dz||_F <= 2^-11 ||z||_F (Up has orthonormal rows), plus float32 slack
    bound = 2.0**-11 * float(z.norm()) + 1e-4 * float(res.norm())
    assert float((out - kv).norm()) <= bound
    torch.testing.assert_close(out, kv, rtol=0, atol=5e-3)


@pytest.mark.parametrize("r", [4, 16, 40])
def test_truncated_error_within_dropped_singular_energy(r):
    kv = clustered_kv(120, 48, seed=r)
    res, _ = dk.residuals(kv, 0.2, 2)
    down, up = deltakv_fit.fit_down_up(res, r)
    assert down.dtype == up.dtype == torch.float32 and down.shape == (48, r) and up.shape == (r, 48)
    torch.testing.assert_close(up @ down, torch.eye(r), rtol=0, atol=1e-5)
    dropped = dropped_energy(res, r)
    eps = 1e-5 * float(res.norm()) ** 2
    # the projection reaches the Eckart-Young optimum
    proj_err = float((res.double() - res.double() @ down.double() @ up.double()).norm() ** 2)
    assert proj_err <= dropped + eps
    assert proj_err >= dropped - eps
    # a random rank-r orthonormal pair never beats it
    other, _ = torch.linalg.qr(rand(48, r, seed=99).double())
    assert float((res.double() - res.double() @ other @ other.T).norm() ** 2) >= dropped - eps
    # through the codec: 16-bit latents add at most 2^-11 ||z||_F
    enc = dk.encode(kv, down, center_ratio=0.2, neighbors=2, latent_bits=16)
    err = float((dk.decode(enc, up) - kv).norm())
    assert err <= math.sqrt(dropped) + 2.0**-11 * float((res @ down).norm()) + 1e-3 * math.sqrt(eps)


@pytest.mark.parametrize("r", [32, 64])
def test_int4_error_bounded_by_quantisation_step(r):
    kv = clustered_kv(150, 96, seed=r + 1)
    res, _ = dk.residuals(kv, 0.1, 2)
    down, up = deltakv_fit.fit_down_up(res, r)
    enc = dk.encode(kv, down, center_ratio=0.1, neighbors=2, latent_bits=4)
    assert enc.latents.dtype == torch.uint8 and enc.latents.shape == (150 - 15, r // 2)
    z = res @ down
    dz = enc.dense_latents() - z
    half_step = enc.scales.float().repeat_interleave(32, dim=1) / 2
    assert bool((dz.abs() <= half_step * (1 + 1e-4) + 1e-6).all())
    err = float((dk.decode(enc, up) - kv).norm())
    assert err <= math.sqrt(dropped_energy(res, r)) + float(half_step.norm()) + 1e-4 * float(res.norm())


def test_int4_quantiser_edges():
    z = torch.cat([torch.full((1, 32), 0.7), torch.linspace(-5, 3, 32)[None]])
    packed, scale, zero = dk.quantize_int4(z)
    deq = dk.dequantize_int4(packed, scale, zero)
    assert float((deq[0] - 0.7).abs().max()) <= 1e-3  # constant group: zero step, exact to f16
    assert float((deq[1] - z[1]).abs().max()) <= float(scale[1, 0]) / 2 * (1 + 1e-4)
    assert dk.unpack_int4(packed)[1].tolist()[:2] == [0, 0] and dk.unpack_int4(packed)[1, -1] == 15
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    assert torch.equal(dk.unpack_int4(codes[:, 0::2] | (codes[:, 1::2] << 4)), codes)


@pytest.mark.parametrize("bits", [4, 16])
def test_decode_subset_and_extend(bits):
    kv = clustered_kv(77, 64, seed=7)
    down, up = deltakv_fit.fit_down_up(dk.residuals(kv, 0.125, 3)[0], 32)
    whole = dk.encode(kv, down, center_ratio=0.125, neighbors=3, latent_bits=bits)
    parts = dk.extend(dk.encode(kv[:29], down, center_ratio=0.125, neighbors=3, latent_bits=bits), kv[29:], down)
    for name in ("centers", "neighbors", "latents", "scales", "zeros"):
        assert torch.equal(getattr(whole, name), getattr(parts, name)), name
    assert parts.n == whole.n == 77
    full = dk.decode(whole, up)
    pick = torch.tensor([76, 0, 5, 8, 40, 41, 17])
    # One matmul rebuilds the rows; its blocking (so the last float bits) follows the row count.
    torch.testing.assert_close(dk.decode(whole, up, pick), full[pick], rtol=1e-6, atol=1e-6)
    assert torch.equal(dk.decode(whole, up, pick), dk.decode_at(whole, up, pick))
    centers = pick[pick % whole.stride == 0]
    assert torch.equal(dk.decode(whole, up, centers), kv[centers].float())  # centers come back exactly


def test_split_rows_equals_the_position_masks():
    """The rows `encode_tail` reads without a boolean mask: centers (position a multiple of
    the stride) and the others, each ascending, for appends at every offset."""
    for stride in (1, 2, 3, 10):
        for n_old in range(0, 25):
            for m in (0, 1, 2, 7, 13, 64):
                pos = torch.arange(n_old, n_old + m)
                centers, others = dk.split_rows(n_old, m, stride, "cpu")
                is_center = pos % stride == 0
                assert torch.equal(centers, torch.nonzero(is_center).flatten()), (stride, n_old, m)
                assert torch.equal(others, torch.nonzero(~is_center).flatten()), (stride, n_old, m)


# ---------------------------------------------------------------------------- bytes


def test_byte_accounting_hand_count():
    # n=20, stride 4: centers 0,4,8,12,16 (5), 15 others. D = 2*2*16 = 64, bf16.
    # center: 64 * 2 = 128 B; other: 32 int4 codes = 16 B + one group's f16 scale and
    # min = 4 B + 2 int16 neighbour indices = 4 B -> 24 B. 5*128 + 15*24 = 1000 B.
    acct = deltakv_bytes.stored_bytes_per_token(20, 2, 16, 32, 0.25, 2, 4, kv_bytes=2)
    assert (acct.centers, acct.center_bytes, acct.latent_bytes, acct.index_bytes) == (5, 640, 300, 60)
    assert acct.stored_bytes == 1000 and acct.dense_bytes == 20 * 128
    assert acct.stored_per_token == 50.0 and acct.dense_per_token == 128.0
    assert acct.ratio == pytest.approx(1000 / 2560)
    kv = rand(20, 64, seed=0, dtype=torch.bfloat16)
    down = torch.linalg.qr(rand(64, 32, seed=1))[0]
    assert dk.encode(kv, down, center_ratio=0.25, neighbors=2, latent_bits=4).nbytes() == 1000
    # 16-bit latents: other = 32 * 2 + 4 = 68 B -> 640 + 15 * 68 = 1660 B
    assert deltakv_bytes.stored_bytes_per_token(20, 2, 16, 32, 0.25, 2, 16).stored_bytes == 1660
    assert dk.encode(kv, down, center_ratio=0.25, neighbors=2, latent_bits=16).nbytes() == 1660


def test_byte_accounting_default_shape_is_well_below_dense():
    acct = deltakv_bytes.stored_bytes_per_token(131072, 8, 128, 256, 0.1, 4, 4)
    assert acct.dense_per_token == 2 * 8 * 128 * 2
    assert 0.1 < acct.ratio < 0.2


# ------------------------------------------------------------------------ checkpoint


def test_checkpoint_round_trip(tmp_path):
    layers = {0: deltakv_fit.fit_down_up(rand(50, 16, seed=1), 8),
              3: deltakv_fit.fit_down_up(rand(50, 16, seed=2), 8)}
    meta = {"model_name": "tiny-llama", "latent_dim": 8, "center_ratio": 0.1, "neighbors": 4, "text": "calib.txt"}
    path = tmp_path / "deltakv.safetensors"
    deltakv_fit.save_checkpoint(path, layers, meta)
    got, got_meta = deltakv_fit.load_checkpoint(path)
    assert list(got) == [0, 3]
    for layer, (down, up) in layers.items():
        assert torch.equal(got[layer][0], down) and torch.equal(got[layer][1], up)
    assert got_meta["model_name"] == "tiny-llama" and got_meta["latent_dim"] == 8
    assert got_meta["center_ratio"] == 0.1 and got_meta["neighbors"] == 4 and got_meta["text"] == "calib.txt"


def test_checkpoint_errors(tmp_path):
    pair = deltakv_fit.fit_down_up(rand(20, 16, seed=1), 8)
    path = tmp_path / "a.safetensors"
    with pytest.raises(ValueError, match="neighbors"):
        deltakv_fit.save_checkpoint(path, {0: pair}, {"model_name": "m", "latent_dim": 8, "center_ratio": 0.1})
    with pytest.raises(ValueError, match="latent_dim=4"):
        deltakv_fit.save_checkpoint(path, {0: pair},
                                    {"model_name": "m", "latent_dim": 4, "center_ratio": 0.1, "neighbors": 2})
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a DeltaKV checkpoint"):
        deltakv_fit.load_checkpoint(tmp_path / "other.safetensors")


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: dk.encode(rand(10, 64, seed=0), rand(64, 32, seed=0), center_ratio=0.1, neighbors=2,
                           latent_bits=8), "deltakv_latent_bits"),
        (lambda: dk.encode(rand(10, 64, seed=0), rand(64, 20, seed=0), center_ratio=0.1, neighbors=2,
                           latent_bits=4), "multiple of 32"),
        (lambda: dk.encode(rand(10, 64, seed=0), rand(48, 32, seed=0), center_ratio=0.1, neighbors=2),
         r"down must be \[D=64"),
        (lambda: dk.encode(rand(10, 64, seed=0), rand(64, 32, seed=0), center_ratio=0.1, neighbors=0),
         "deltakv_neighbors"),
        (lambda: deltakv_fit.fit_down_up(rand(10, 16, seed=0), 17), "deltakv_latent_dim=17"),
        (lambda: dk.split_kv(rand(3, 10, seed=0), 2, 4), r"\[n, 16\]"),
        (lambda: deltakv_bytes.stored_bytes_per_token(0, 2, 4, 32, 0.1, 2, 4), "n must be"),
    ],
)
def test_bad_input_raises_naming_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_decode_rejects_bad_positions():
    kv = rand(30, 64, seed=0)
    down, up = deltakv_fit.fit_down_up(dk.residuals(kv, 0.1, 2)[0], 32)
    enc = dk.encode(kv, down, center_ratio=0.1, neighbors=2)
    with pytest.raises(ValueError, match="n=30"):
        dk.decode(enc, up, torch.tensor([30]))
    with pytest.raises(ValueError, match=r"up must be \[r, D=64\]"):
        dk.decode(enc, down)


def test_rebuild_reads_the_chosen_rows_of_each_layer():
    """Per layer, up to `budget` history tokens: an int4 latent row (codes, f16 scale and
    min per group of 32), k neighbour indices, k neighbour centers and the rebuilt K+V."""
    gen = torch.Generator().manual_seed(0)
    D, r, k = 64, 64, 3
    encs = [dk.encode(torch.randn(n, D, generator=gen), torch.randn(D, r, generator=gen), center_ratio=0.1,
                      neighbors=k, latent_bits=4) for n in (200, 40)]
    assert all(e.centers.dtype == torch.float32 for e in encs)

    def per_token(e):
        return r // 2 + (r // 32) * 2 * 2 + k * e.neighbors.element_size() + k * D * 4 + 256

    got = deltakv_bytes.rebuild_read_bytes(encs, 100, 256)
    assert got == 100 * per_token(encs[0]) + 40 * per_token(encs[1])  # the second layer holds 40 < 100
