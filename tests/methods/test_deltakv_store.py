"""DeltaKV's codec store: appending into fixed buffers stores exactly what the codec's
`encode` of the whole history stores; the buffers keep their addresses until a history
outgrows them (then they move, content kept, and `generation` says so); decoding the
whole buffers equals decoding the used rows."""
import pytest
import torch

from sparseengine.methods import deltakv_codec as dk
from sparseengine.methods import deltakv_fit
from sparseengine.kernels.deltakv_rebuild import codec_addresses
from sparseengine.methods.deltakv_store import CodecStore, append_layers

FIELDS = ("centers", "neighbors", "latents", "scales", "zeros")


def _kv(n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(8, dim, generator=g)
    return base[torch.randint(0, 8, (n,), generator=g)] + 0.1 * torch.randn(n, dim, generator=g)


@pytest.mark.parametrize("bits", [4, 16])
@pytest.mark.parametrize("capacity", [200, 60])  # 60: the history outgrows it twice
def test_appends_store_what_encode_stores(bits, capacity):
    kv = _kv(157, 64, seed=3)
    down, up = deltakv_fit.fit_down_up(dk.residuals(kv, 0.125, 3)[0], 32)
    whole = dk.encode(kv, down, center_ratio=0.125, neighbors=3, latent_bits=bits)
    store = CodecStore(capacity, whole.stride, bits, 3, 64, 32, kv.dtype, "cpu")
    store.write(dk.encode(kv[:41], down, center_ratio=0.125, neighbors=3, latent_bits=bits))
    address, generations = store.centers.data_ptr(), [store.generation]
    for lo, hi in ((41, 100), (100, 101), (101, 157)):
        store.append(kv[lo:hi], down)
        generations.append(store.generation)
    view = store.view()
    assert view.n == whole.n == 157 and view.stride == whole.stride and view.latent_bits == bits
    for name in FIELDS:
        assert torch.equal(getattr(view, name), getattr(whole, name).to(getattr(view, name).dtype)), name
    moved = store.centers.data_ptr() != address
    assert moved == (capacity < 157) and (generations[-1] > 0) == moved  # it moves only when outgrown
    assert generations == sorted(generations)
    pos = torch.tensor([0, 5, 8, 40, 41, 99, 100, 156])
    assert torch.equal(dk.decode_at(store.full(), up, pos), dk.decode_at(view, up, pos))
    with pytest.raises(RuntimeError, match="append to it"):
        store.write(whole)


@pytest.mark.parametrize("bits", [4, 16])
def test_layers_encoded_together_equal_each_layer_alone(bits):
    """A flush encodes every sparse layer's new tokens at once (`encode_tail_layers`): the
    same centers, neighbours and latents as encoding each layer's on its own, stored
    through `append_encoded` as `append` stores them."""
    layers, n_old, m = 3, 41, 23
    kvs = [_kv(n_old + m, 64, seed=10 + layer) for layer in range(layers)]
    downs = [deltakv_fit.fit_down_up(dk.residuals(kv, 0.125, 3)[0], 32)[0] for kv in kvs]
    olds = [dk.encode(kv[:n_old], down, center_ratio=0.125, neighbors=3, latent_bits=bits)
            for kv, down in zip(kvs, downs)]
    new = dk.encode_tail_layers([o.centers for o in olds], n_old, torch.stack([kv[n_old:] for kv in kvs]),
                                torch.stack(downs), olds[0].stride, 3, bits)
    for layer in range(layers):
        alone = dk.encode_tail(olds[layer].centers, n_old, kvs[layer][n_old:], downs[layer], olds[0].stride, 3, bits)
        c_old = olds[layer].centers.shape[0]
        assert torch.equal(new[0][layer], alone[0][c_old:]), f"layer {layer} centers"
        for name, got, want in zip(FIELDS[1:], (p[layer] for p in new[1:]), alone[1:]):
            assert torch.equal(got, want), f"layer {layer} {name}"
        a, b = (CodecStore(200, olds[0].stride, bits, 3, 64, 32, torch.float32, "cpu") for _ in range(2))
        a.write(olds[layer])
        b.write(olds[layer])
        a.append(kvs[layer][n_old:], downs[layer])
        b.append_encoded(m, *(p[layer] for p in new))
        for name in FIELDS:
            assert torch.equal(getattr(a.view(), name), getattr(b.view(), name)), f"layer {layer} stored {name}"
        assert (a.n, a.c, a.m) == (b.n, b.c, b.m) == (n_old + m, a.c, a.m)


@pytest.mark.parametrize("bits", [4, 16])
@pytest.mark.parametrize("capacity", [200, 50])  # 50: every store outgrows its buffers in the one call
def test_append_layers_stores_what_each_store_appends_alone(bits, capacity):
    """A flush writes every layer's new parts with one multi-tensor copy
    (`deltakv_store.append_layers`): the same rows as appending store by store."""
    layers, n_old, m = 3, 41, 23
    kvs = [_kv(n_old + m, 64, seed=20 + layer) for layer in range(layers)]
    down = deltakv_fit.fit_down_up(dk.residuals(kvs[0], 0.125, 3)[0], 32)[0]
    olds = [dk.encode(kv[:n_old], down, center_ratio=0.125, neighbors=3, latent_bits=bits) for kv in kvs]
    new = dk.encode_tail_layers([o.centers for o in olds], n_old, torch.stack([kv[n_old:] for kv in kvs]),
                                down.expand(layers, -1, -1), olds[0].stride, 3, bits)
    together = [CodecStore(capacity, olds[0].stride, bits, 3, 64, 32, torch.float32, "cpu") for _ in range(layers)]
    alone = [CodecStore(capacity, olds[0].stride, bits, 3, 64, 32, torch.float32, "cpu") for _ in range(layers)]
    for a, b, old in zip(together, alone, olds):
        a.write(old)
        b.write(old)
    append_layers(together, m, *new)
    for i, (a, b) in enumerate(zip(together, alone)):
        b.append(kvs[i][n_old:], down)
        assert (a.n, a.c, a.m, a.generation) == (b.n, b.c, b.m, b.generation)
        for name in FIELDS:
            assert torch.equal(getattr(a.view(), name), getattr(b.view(), name)), f"store {i} {name}"
        assert a.addresses.tolist() == list(codec_addresses(a.full()))  # kept current when the buffers moved
    together[0].n += 1
    with pytest.raises(RuntimeError, match="histories differ"):
        append_layers(together, m, *new)


@pytest.mark.parametrize("bits", [4, 16])
def test_a_flush_overflow_check_is_kept_then_raised(bits):
    """A flush's latents overflowing float16: ``encode_tail_layers`` with ``defer`` returns
    and leaves the failed check in the list; the request's state raises it when it settles
    (on the CPU at once; on a GPU once the flag has reached the host, or when the request
    ends)."""
    from sparseengine.methods.deltakv_store import RequestState

    kv = _kv(40, 64, seed=5)
    down = torch.full((1, 64, 32), 1e4)  # latents ~1e6: past float16
    checks = []
    dk.encode_tail_layers(kv[None, :8], 8, kv[None, 8:], down, 4, 2, bits, defer=checks)
    assert len(checks) == 1 and not bool(checks[0][0])
    st = RequestState(hist_end=0)
    with pytest.raises(ValueError, match="overflow"):
        st.defer(checks)
    ok = []
    dk.encode_tail_layers(kv[None, :8], 8, kv[None, 8:], down / 1e4, 4, 2, bits, defer=ok)
    st.defer(ok)
    assert bool(ok[0][0]) and st.checks == []
    with pytest.raises(ValueError, match="overflow"):  # without defer: at once
        dk.encode_tail_layers(kv[None, :8], 8, kv[None, 8:], down, 4, 2, bits)


@pytest.mark.gpu
def test_a_deferred_check_is_read_once_it_reaches_the_host():
    from sparseengine.methods.deltakv_store import RequestState

    st = RequestState(hist_end=0)
    bad = torch.tensor(False, device="cuda")
    torch.cuda._sleep(1 << 28)  # keeps the device busy: the flag's copy waits behind it
    st.defer([(bad, "overflowed")])  # returns without waiting: the check stays pending
    assert len(st.checks) == 1
    with pytest.raises(ValueError, match="overflowed"):
        st.settle(wait=True)
    assert st.checks == []
