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
