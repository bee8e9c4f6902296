"""The decode-size linear layers with their prologue fused (`kernels.small_m_linear`)
against the torch compositions they replace, on fresh random inputs: the plain layer, SiLU-
and-multiply then the layer, residual add + RMSNorm then the layer (the new residual
bit for bit); row counts 1 to 16, sizes off the tiles, a bias, a strided x. The model's
dispatch (`layers.linear`) launches them for at most 16 rows and not for more. Under the
interpreter in float32 and float16 (its bfloat16 dot is not numpy's); bf16 on the GPU."""
from __future__ import annotations

import pytest
import torch

from sparseengine.kernels import fused_ops
from sparseengine.kernels import small_m_linear as sml
from sparseengine.kernels.testing import assert_close, randn, record_launches

CASES = [(1, 40, 72, dict(block_n=16, block_k=32)), (5, 33, 128, dict(block_n=32, block_k=64)),
         (16, 64, 50, dict(block_n=16, block_k=16)), (3, 17, 200, dict(block_n=64, block_k=128, num_stages=2))]
TOL = {torch.float32: 1e-5, torch.float16: 4e-3}


def _inputs(gen, device, dtype, m, n, k):
    x = randn(m, k, generator=gen, device=device, dtype=dtype)
    w = (randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
    return x, w, randn(n, generator=gen, device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k,tile", CASES, ids=lambda c: str(c) if not isinstance(c, dict) else "")
def test_plain_and_silu_mul(m, n, k, tile, dtype, gen, device):
    x, w, bias = _inputs(gen, device, dtype, m, n, k)
    tol = TOL[dtype]
    assert_close(sml.small_m_linear_triton(x, w, **tile), sml.small_m_linear_ref(x, w), tol, "plain")
    assert_close(sml.small_m_linear_triton(x, w, bias, **tile), sml.small_m_linear_ref(x, w, bias), tol, "bias")
    wide = randn(m, 2 * k, generator=gen, device=device, dtype=dtype)[:, ::2]  # row stride 2k
    assert_close(sml.small_m_linear_triton(wide, w, **tile), sml.small_m_linear_ref(wide, w), tol, "strided x")
    gate_up = randn(m, 2 * k, generator=gen, device=device, dtype=dtype) * 3
    assert_close(sml.silu_mul_linear_triton(gate_up, w, **tile), sml.silu_mul_linear_ref(gate_up, w), tol, "silu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k,tile", CASES, ids=lambda c: str(c) if not isinstance(c, dict) else "")
def test_rms_norm_linear(m, n, k, tile, dtype, gen, device):
    x, w, bias = _inputs(gen, device, dtype, m, n, k)
    residual = randn(m, k, generator=gen, device=device, dtype=dtype) * 4
    norm_w = (torch.rand(k, generator=gen) * 0.4 + 0.8).to(device, dtype)
    y, h = sml.rms_norm_linear_triton(x, residual, norm_w, 1e-5, w, bias, **tile)
    want_y, want_h = sml.rms_norm_linear_ref(x, residual, norm_w, 1e-5, w, bias)
    assert torch.equal(h, want_h), "the new residual is x + residual, rounded as torch rounds it"
    assert_close(y, want_y, TOL[dtype], "with residual")
    y, h = sml.rms_norm_linear_triton(x, None, norm_w, 1e-5, w, **tile)
    assert h is x
    assert_close(y, sml.rms_norm_linear_ref(x, None, norm_w, 1e-5, w)[0], TOL[dtype], "no residual")


def test_bad_inputs_name_the_problem(gen, device):
    x, w, bias = _inputs(gen, device, torch.float32, 2, 4, 8)
    with pytest.raises(ValueError, match=r"x must be \[M, K\] for w \[N=4, K=6\]"):
        sml.small_m_linear_triton(x, w[:, :6].contiguous())
    with pytest.raises(ValueError, match=r"\[M, 2K\] \(gate, then up\)"):
        sml.silu_mul_linear_triton(x, w)
    with pytest.raises(ValueError, match="at most 16 rows, got 17"):
        sml.small_m_linear_triton(randn(17, 8, generator=gen, device=device), w)
    with pytest.raises(ValueError, match="share a dtype"):
        sml.small_m_linear_triton(x.double(), w)
    with pytest.raises(ValueError, match="contiguous along K"):
        sml.small_m_linear_triton(x, randn(8, 4, generator=gen, device=device).T)
    with pytest.raises(ValueError, match=r"bias must be \[N=4\]"):
        sml.small_m_linear_triton(x, w, bias[:3])
    with pytest.raises(ValueError, match=r"residual must be x's shape"):
        sml.rms_norm_linear_triton(x, x[:1], torch.ones(8, device=device), 1e-5, w)
    with pytest.raises(ValueError, match=r"norm weight must be \[K=8\]"):
        sml.rms_norm_linear_triton(x, None, torch.ones(7, device=device), 1e-5, w)
    with pytest.raises(ValueError, match="norm weight must have x's dtype"):
        sml.rms_norm_linear_triton(x, None, torch.ones(8, device=device).half(), 1e-5, w)


def test_model_dispatch_fuses_for_small_batches_only(gen, device, monkeypatch):
    """With the linear kernels on, a decoder layer of 5 rows runs its projections as the
    three fused kernels (no separate norm or SiLU launch) and matches the separate ops;
    at 17 rows it launches none of them."""
    from .test_fused_ops import _forward_pair

    with record_launches() as rec:
        fused, plain = _forward_pair("tiny-llama", torch.float32, device, ("linear",), monkeypatch)
    assert_close(fused, plain, 1e-4, "hidden states")
    prologues = {b["constexprs"]["PROLOGUE"] for b in rec.launches if b["kernel"] == "_small_m_linear_kernel"}
    assert prologues == {0, 1, 2}, prologues
    if device == "cpu":  # on CPU the norms and SiLU are the torch references: no other kernel ran
        assert {b["kernel"] for b in rec.launches} == {"_small_m_linear_kernel"}

    from sparseengine.layers import linear as L
    from sparseengine.layers.layernorm import RMSNorm

    proj, norm = torch.nn.Linear(24, 8).to(device), RMSNorm(24, 1e-5).to(device)
    for rows, want in ((16, {0, 1, 2}), (17, set())):
        x = randn(rows, 24, generator=gen, device=device)
        with fused_ops.forced(True, ("linear",)), record_launches() as rec:
            L.linear(x, proj)
            L.norm_linear(x, x, norm, proj)
            L.silu_mul_linear(torch.cat([x, x], 1), proj)
        assert {b["constexprs"]["PROLOGUE"] for b in rec.launches if b["kernel"] == "_small_m_linear_kernel"} == want


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 6, 16])
def test_gpu_bf16_llama_shapes(m, gen):
    """bf16 at the Llama-3.1-8B shapes, with the engine's tiles: within bf16 rounding of
    cuBLAS after the separate ops."""
    x = randn(m, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    residual = randn(m, 4096, generator=gen, device="cuda", dtype=torch.bfloat16) * 4
    norm_w = (torch.rand(4096, generator=gen) * 0.4 + 0.8).to("cuda", torch.bfloat16)
    for n in (6144, 28672):
        w = (randn(n, 4096, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        y, h = sml.rms_norm_linear_triton(x, residual, norm_w, 1e-5, w)
        want_y, want_h = sml.rms_norm_linear_ref(x, residual, norm_w, 1e-5, w)
        assert torch.equal(h, want_h)
        assert_close(y, want_y, 1e-2, f"norm + {n}")
    gate_up = randn(m, 2 * 14336, generator=gen, device="cuda", dtype=torch.bfloat16) * 3
    w = (randn(4096, 14336, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    assert_close(sml.silu_mul_linear_triton(gate_up, w), sml.silu_mul_linear_ref(gate_up, w), 1e-2, "silu + down")
    w = (randn(4096, 4096, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    assert_close(sml.small_m_linear_triton(x, w), sml.small_m_linear_ref(x, w), 1e-2, "o")
