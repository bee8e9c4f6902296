import pytest
import torch

from sparseengine.kernels import deltakv_rebuild_ref, deltakv_rebuild_triton
from sparseengine.kernels.testing import assert_close, randn


def _rope_tables(max_pos, d, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(max_pos).float()[:, None] * inv[None, :]
    return torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()


def _inputs(N, r, hkv, d, gen, device, dtype=torch.float32):
    z = randn(N, r, generator=gen, device=device, dtype=dtype)
    up = randn(r, 2 * hkv * d, generator=gen, device=device, dtype=dtype) / r**0.5
    mean = randn(N, 2 * hkv * d, generator=gen, device=device, dtype=dtype)
    pos = torch.randint(0, 500, (N,), generator=gen).to(device)
    cos, sin = (t.to(device) for t in _rope_tables(500, d))
    return z, up, mean, pos, cos, sin


@pytest.mark.parametrize("N,r,hkv,d", [(1, 16, 4, 16), (37, 24, 2, 32), (70, 40, 3, 64)])
def test_rebuild(N, r, hkv, d, gen, device):
    args = _inputs(N, r, hkv, d, gen, device)
    z, up, mean, pos, cos, sin = args
    k_ref, v_ref = deltakv_rebuild_ref(*args, hkv)
    # plainest: the rotation as complex multiplication of channel pairs (c, c + d/2)
    kv = z.double() @ up.double() + mean.double()
    k_raw = kv[:, : hkv * d].reshape(N, hkv, d)
    half = d // 2
    theta = torch.atan2(sin[pos, :half].double(), cos[pos, :half].double())[:, None, :]
    rotated = torch.complex(k_raw[..., :half], k_raw[..., half:]) * torch.exp(1j * theta)
    assert_close(k_ref, torch.cat([rotated.real, rotated.imag], -1).float(), 1e-5, "ref k")
    assert_close(v_ref, kv[:, hkv * d:].reshape(N, hkv, d).float(), 1e-5, "ref v")
    k, v = deltakv_rebuild_triton(*args, hkv)
    assert_close(k, k_ref, 1e-4, "k")
    assert_close(v, v_ref, 1e-4, "v")


def test_fp16_out(gen, device):
    args = _inputs(21, 32, 2, 32, gen, device, torch.float16)
    for got, want in zip(deltakv_rebuild_triton(*args, 2), deltakv_rebuild_ref(*args, 2)):
        assert got.dtype == torch.float16
        assert_close(got, want, 2e-3)


@pytest.mark.gpu
def test_gpu_bf16(gen):
    args = _inputs(4096, 256, 8, 128, gen, "cuda", torch.bfloat16)
    for got, want in zip(deltakv_rebuild_triton(*args, 8), deltakv_rebuild_ref(*args, 8)):
        assert_close(got, want, 2e-2)
