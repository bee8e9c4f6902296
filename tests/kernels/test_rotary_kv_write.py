"""Rotary embedding and the paged KV write in one launch (`fused_ops.rotary_kv_write_triton`)
against the two steps it replaces, bit for bit; the Triton provider's use of it."""

from __future__ import annotations

import pytest
import torch

from sparseengine.kernels import fused_ops
from sparseengine.kernels.fused_ops import rotary_kv_write_triton, rotary_qk_ref
from sparseengine.kernels.paged_kv_write import paged_kv_write_ref
from sparseengine.kernels.testing import record_launches
from .test_fused_ops import DTYPES, HEADS, TOKENS, _cos_sin, _qk_views, _randn, assert_equal


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("T", TOKENS)
def test_rotary_kv_write(T, heads, dtype, gen, device):
    """One launch: q rotated as `rotary_qk` rotates it, k rotated and v written at their
    slots as `paged_kv_write` writes them, bit for bit; slot -1 (a padding row) writes
    nothing; every other slot of the caches keeps its value."""
    hq, hkv = heads
    d, ps = 64, 4
    q, k = _qk_views(gen, T, hq, hkv, d, dtype, device)
    v = _randn(gen, T, hkv, d, dtype=dtype, device=device)
    cos, sin = _cos_sin(gen, T, d, dtype, device)
    caches = [_randn(gen, 9, ps, hkv, d, dtype=dtype, device=device) for _ in range(2)]
    slots = torch.randperm(9 * ps, generator=gen)[:T].to(device)
    slots[T // 2] = -1
    want_q, want_k = rotary_qk_ref(q, k, cos, sin)
    want = [c.clone() for c in caches]
    paged_kv_write_ref(want_k, v, *want, slots)
    got_q = rotary_kv_write_triton(q, k, v, cos, sin, *caches, slots)
    assert_equal(got_q, want_q, "q")
    assert_equal(caches[0], want[0], "k cache")
    assert_equal(caches[1], want[1], "v cache")


def test_rotary_kv_write_checks_its_inputs(gen, device):
    q, k = _qk_views(gen, 2, 4, 2, 64, torch.float32, device)
    cos, sin = _cos_sin(gen, 2, 64, torch.float32, device)
    cache = torch.zeros(3, 4, 2, 64, device=device)
    slots = torch.tensor([0, 5], device=device)
    with pytest.raises(ValueError, match="share a dtype"):
        rotary_kv_write_triton(q, k, k, cos, sin, cache.bfloat16(), cache.bfloat16(), slots)
    with pytest.raises(ValueError, match="contiguous heads"):
        rotary_kv_write_triton(q, k, k, cos, sin, cache[:, :, :1], cache[:, :, :1], slots)
    with pytest.raises(ValueError, match=r"slot_mapping must be \[T=2\]"):
        rotary_kv_write_triton(q, k, k, cos, sin, cache, cache.clone(), slots[:1])


def test_triton_provider_rotates_and_writes_in_one_launch(gen, device):
    """The Triton provider rotates and writes in one launch where the rotation is a kernel,
    in the two steps (torch rotation, then its KV write kernel) where it is not: the same q
    and caches either way."""
    from sparseengine.attention.triton_provider import TritonAttentionProvider

    q, k = _qk_views(gen, 5, 4, 2, 64, torch.bfloat16, device)
    v = _randn(gen, 5, 2, 64, dtype=torch.bfloat16, device=device)
    cos, sin = _cos_sin(gen, 5, 64, torch.bfloat16, device)
    slots = torch.tensor([3, 17, -1, 0, 30], device=device)
    outs = []
    for fused in (True, False):
        caches = [torch.zeros(8, 4, 2, 64, dtype=torch.bfloat16, device=device) for _ in range(2)]
        provider = TritonAttentionProvider()
        with fused_ops.forced(fused, ("rotary_qk",)), record_launches() as rec:
            outs.append((provider.rotate_write_kv(q, k, v, cos, sin, *caches, slots), *caches))
        launched = [b["kernel"] for b in rec.launches]
        assert launched == (["_rotary_kv_write_kernel"] if fused else ["_kv_write_kernel"]), launched
    for got, want in zip(*outs):
        assert_equal(got, want)
