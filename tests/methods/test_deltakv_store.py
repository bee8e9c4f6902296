"""DeltaKV's codec store: appending into fixed buffers stores exactly what the codec's
`encode` of the whole history stores; the buffers keep their addresses until a history
outgrows them (then they move, content kept, and `generation` says so); decoding the
whole buffers equals decoding the used rows."""
import pytest
import torch

from sparseengine.methods import deltakv_codec as dk
from sparseengine.methods import deltakv_fit
from sparseengine.methods.deltakv_store import CodecStore

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
def test_layers_appended_together_store_what_each_append_stores(bits):
    """One request's layers at a flush: encoded together (one top-k and one product per
    layer, the rest batched), each layer stores bit for bit what its own append stores,
    across a buffer move (capacity 60 < 157 tokens)."""
    layers = 3
    kv = torch.stack([_kv(157, 64, seed=10 + layer) for layer in range(layers)])
    downs = [deltakv_fit.fit_down_up(dk.residuals(kv[layer], 0.125, 3)[0], 32)[0] for layer in range(layers)]
    alone = [CodecStore(60, 8, bits, 3, 64, 32, kv.dtype, "cpu") for _ in range(layers)]
    together = [CodecStore(60, 8, bits, 3, 64, 32, kv.dtype, "cpu") for _ in range(layers)]
    for layer in range(layers):
        for st in (alone[layer], together[layer]):
            st.write(dk.encode(kv[layer, :41], downs[layer], center_ratio=0.125, neighbors=3, latent_bits=bits))
    for lo, hi in ((41, 100), (100, 101), (101, 157)):
        for layer in range(layers):
            alone[layer].append(kv[layer, lo:hi], downs[layer])
        CodecStore.append_layers(together, kv[:, lo:hi], downs)
    for a, t in zip(alone, together):
        assert (t.n, t.c, t.m, t.generation) == (a.n, a.c, a.m, a.generation)
        for name in FIELDS:
            assert torch.equal(getattr(t.view(), name), getattr(a.view(), name)), name
    with pytest.raises(ValueError, match="different lengths"):
        CodecStore.append_layers([together[0], CodecStore(60, 8, bits, 3, 64, 32, kv.dtype, "cpu")], kv[:2, :5],
                                 downs[:2])
