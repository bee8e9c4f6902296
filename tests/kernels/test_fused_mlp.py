"""`fused_mlp_triton` (the decode step's MLP as one launch: gate_up with the folded norm,
SiLU-and-multiply, down with the residual) on fresh random inputs: its hidden state h
against the exact gate/up rounded as the model rounds them, its output against the exact
down projection of that h, the same with tensor-descriptor loads and other tiles and
parts, its counters back at zero, the errors for bad input; on the GPU the Llama-3.1-8B
shape against the unfused engine path (`skinny_linear` + `silu_mul`), on full and odd
grids, and the model's MLP with the switch on and off."""
import pytest
import torch
import torch.nn.functional as F

from sparseengine.kernels import fused_mlp
from sparseengine.kernels.fused_mlp import fused_mlp_ref, fused_mlp_triton


def _inputs(gen, device, M, H, I, dtype):
    x = (torch.randn(M, H, generator=gen) * 2 + 0.5).to(dtype).to(device)  # rows whose rms is not 1
    w_gate_up = (torch.randn(2 * I, H, generator=gen) / H ** 0.5).to(dtype).to(device)
    w_down = (torch.randn(H, I, generator=gen) / I ** 0.5).to(dtype).to(device)
    res = torch.randn(M, H, generator=gen).to(dtype).to(device)
    return x, w_gate_up, w_down, res


def _check(y, h, x, w_gate_up, w_down, eps, res):
    """h: the exact gate and up (float64), rounded to the dtype as the gate_up linear's output,
    then torch's SiLU-and-multiply in that dtype; a float32 sum can round the other way at a
    tie, so at most 1% of h may differ (0.38% at the 8B shape on the H200), by at most 2 ulps (float32: within 1e-4). y: within float32 rounding
    of the exact down projection of the kernel's own h, plus its rounding and the residual
    add's."""
    I = w_down.shape[1]
    xd = x.double()
    if eps is not None:
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    gu = F.linear(xd, w_gate_up.double()).to(x.dtype)
    want_h = (F.silu(gu[:, :I].float()).to(x.dtype).float() * gu[:, I:].float()).to(x.dtype)
    ulp = torch.finfo(x.dtype).eps
    if x.dtype == torch.float32:  # no rounding step to hide the float32 sums' own error in
        assert torch.allclose(h, want_h, rtol=1e-4, atol=1e-4 * want_h.abs().max().item())
    else:
        off = h != want_h
        assert off.float().mean().item() <= 1e-2, f"{int(off.sum())} of {h.numel()} h values differ"
        assert bool(((h.double() - want_h.double()).abs() <= 2 * ulp * want_h.double().abs() + 1e-30).all())
    want = F.linear(h.double(), w_down.double())
    tol = 1e-5 * F.linear(h.double().abs(), w_down.double().abs()) + ulp * want.abs() + 1e-30
    if res is not None:
        want = want + res.double()
        tol = tol + ulp * want.abs()
    err = (y.double() - want).abs()
    assert y.dtype == x.dtype and bool((err <= tol).all()), f"max err {err.max().item():.3g}"


@pytest.mark.parametrize("M,H,I,dtype,tiles", [
    (1, 128, 256, torch.bfloat16, dict(block_k=64)),
    (6, 128, 512, torch.bfloat16, dict(block_k=64, chunks=4)),
    (16, 256, 256, torch.float32, dict(block_k=32, block_n=16, block_n2=16)),
    (5, 64, 128, torch.float32, dict(block_k=64, chunks=1, block_n2=64)),
])
@pytest.mark.parametrize("norm,residual", [(False, False), (True, True)])
def test_matches_the_unfused_math(gen, device, M, H, I, dtype, tiles, norm, residual):
    x, wgu, wd, res = _inputs(gen, device, M, H, I, dtype)
    eps, res = (1e-5 if norm else None), (res if residual else None)
    counters = torch.zeros(fused_mlp.MAX_CHUNKS + 1, dtype=torch.int32, device=device)
    y, h = fused_mlp_triton(x, wgu, wd, rms_eps=eps, residual=res, counters=counters, return_hidden=True, **tiles)
    _check(y, h, x, wgu, wd, eps, res)
    assert not counters.any(), "each launch leaves its counters at zero"
    ref = fused_mlp_ref(x, wgu, wd, rms_eps=eps, residual=res)  # the model's unfused ops
    assert ref.shape == y.shape and (ref.float() - y.float()).abs().max() <= 0.05 * ref.float().abs().max()


@pytest.mark.parametrize("tiles", [dict(), dict(block_n=16, block_n2=64, chunks=4)])
def test_tma_loads(gen, device, tiles):
    """The weights' tiles through tensor descriptors: the plain loads' result, bit for bit."""
    x, wgu, wd, res = _inputs(gen, device, 6, 128, 512, torch.bfloat16)
    kw = dict(rms_eps=1e-5, residual=res, block_k=64, **tiles)
    y = fused_mlp_triton(x, wgu, wd, tma=True, **kw)
    assert torch.equal(y, fused_mlp_triton(x, wgu, wd, **kw))


def test_leading_dims(gen, device):
    x, wgu, wd, res = _inputs(gen, device, 6, 128, 256, torch.float32)
    y = fused_mlp_triton(x.view(2, 3, 128), wgu, wd, residual=res.view(2, 3, 128), block_k=64)
    assert y.shape == (2, 3, 128)
    assert torch.equal(y.reshape(6, 128), fused_mlp_triton(x, wgu, wd, residual=res, block_k=64))


def test_bad_input(device):
    x, wgu, wd = (torch.zeros(*s, device=device) for s in ((2, 128), (512, 128), (128, 256)))
    with pytest.raises(ValueError, match=r"w_gate_up must be \[2I, H\] = \[512, 128\]"):
        fused_mlp_triton(x, wgu[:500], wd)
    with pytest.raises(ValueError, match="x must end in H=128 features"):
        fused_mlp_triton(torch.zeros(2, 64, device=device), wgu, wd)
    with pytest.raises(ValueError, match="fused_mlp needs 1..16 rows, H=128 a multiple of block_k=256"):
        fused_mlp_triton(x, wgu, wd)  # the default block_k
    with pytest.raises(ValueError, match="fused_mlp needs 1..16 rows.* got 17 rows"):
        fused_mlp_triton(torch.zeros(17, 128, device=device), wgu, wd, block_k=64)
    with pytest.raises(ValueError, match="chunks must be an integer >= 1, got 0"):
        fused_mlp_triton(x, wgu, wd, block_k=64, chunks=0)
    with pytest.raises(ValueError, match="chunks must be in \\[1, 8\\], got 9"):
        fused_mlp_triton(x, wgu, wd, block_k=64, chunks=9)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        fused_mlp_triton(x, wgu, wd, block_k=64, block_n=24)
    with pytest.raises(ValueError, match="rms_eps must be a number >= 0 or None, got -1"):
        fused_mlp_triton(x, wgu, wd, block_k=64, rms_eps=-1)
    with pytest.raises(ValueError, match=r"residual must be \(2, 128\) in torch.float32"):
        fused_mlp_triton(x, wgu, wd, block_k=64, residual=torch.zeros(2, 64, device=device))
    with pytest.raises(ValueError, match="counters must be a contiguous int32 vector of at least chunks \\+ 1 = 3"):
        fused_mlp_triton(x, wgu, wd, block_k=64, counters=torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="x and the weights must share a dtype"):
        fused_mlp_triton(x.double(), wgu, wd, block_k=64)
    if device == "cpu":
        with pytest.raises(ValueError, match="the interpreter runs programs one after another: programs must be 1"):
            fused_mlp_triton(x, wgu, wd, block_k=64, programs=2)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 6, 16])
def test_gpu_llama_shape_against_the_unfused_path(gen, M):
    """The Llama-3.1-8B MLP (hidden 4096, intermediate 14336, bf16) at a decode batch's rows,
    with the engine's tiles: the unfused engine path's (skinny_linear with its tiles, the
    SiLU kernel, skinny_linear) h and output within the checks above, on a full grid and
    on 7 programs, 20 launches in a row (counters back at zero each time)."""
    from sparseengine.kernels import silu_mul_triton, skinny_linear

    x, wgu, wd, res = _inputs(gen, "cuda", M, 4096, 14336, torch.bfloat16)
    counters = torch.zeros(fused_mlp.MAX_CHUNKS + 1, dtype=torch.int32, device="cuda")
    kw = dict(rms_eps=1e-5, residual=res, counters=counters, tma=True, **fused_mlp.ENGINE_TILES)
    y, h = fused_mlp_triton(x, wgu, wd, return_hidden=True, **kw)
    _check(y, h, x, wgu, wd, 1e-5, res)
    gu = skinny_linear.skinny_linear_triton(x, wgu, rms_eps=1e-5, **skinny_linear.engine_tiles(28672, device=x.device))
    h0 = silu_mul_triton(gu)
    y0 = skinny_linear.skinny_linear_triton(h0, wd, residual=res, **skinny_linear.engine_tiles(4096, device=x.device))
    assert torch.equal(h, h0) and torch.equal(y, y0)  # the H200 at 8049883: bit for bit
    assert (y.float() - y0.float()).abs().max().item() <= 0.02 * y0.float().abs().max().item()
    for programs in (None, 7):
        for _ in range(20):
            assert torch.equal(fused_mlp_triton(x, wgu, wd, programs=programs, **kw), y)
        torch.cuda.synchronize()
        assert not counters.any()


@pytest.mark.gpu
def test_gpu_model_mlp_switch(gen, monkeypatch):
    """The model's MLP on a decode batch's rows, folded norm and residual: the fused launch
    (`ENGINE_FUSED_MLP`) against the unfused one, at the Llama-3.1-8B widths."""
    from types import SimpleNamespace

    from sparseengine.layers.layernorm import RMSNorm
    from sparseengine.models.llama import MLP

    mlp = MLP(SimpleNamespace(hidden_size=4096, intermediate_size=14336)).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(p) / p.shape[1] ** 0.5)
        norm = RMSNorm(4096, 1e-5).to("cuda", torch.bfloat16)
        x = torch.randn(6, 4096, generator=gen).to("cuda", torch.bfloat16)
        monkeypatch.setattr(fused_mlp, "ENGINE_FUSED_MLP", False)
        y0 = mlp(x, norm=norm, residual=x)
        monkeypatch.setattr(fused_mlp, "ENGINE_FUSED_MLP", True)
        y1 = mlp(x, norm=norm, residual=x)
    assert (y1.float() - y0.float()).abs().max().item() <= 0.02 * y0.float().abs().max().item()
    assert mlp._counters.on(x.device).sum().item() == 0
