"""The fused RMSNorm, rotary and SiLU-mul kernels equal their torch references bit for bit
(torch.equal), and so does a whole forward of the tiny models with them switched in."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparseengine.kernels import fused_ops
from sparseengine.kernels.fused_ops import (add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton,
                                            rotary_qk_ref, rotary_qk_triton, silu_mul_ref, silu_mul_triton)

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 3, 17]
HIDDEN = [96, 576]  # below / above ATen's vectorized-reduction threshold (128); SmolLM2
HEADS = [(4, 2), (9, 3)]
HEAD_DIMS = [64, 128]


def _randn(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _norm_weight(gen, n, dtype, device):
    return (0.5 + torch.rand(n, generator=gen)).to(device=device, dtype=dtype)


def _cos_sin(gen, T, d, dtype, device):
    positions = torch.randint(0, 100_000, (T,), generator=gen).float()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = (positions[:, None] * inv_freq[None, :]).repeat(1, 2)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def _qk_views(gen, T, hq, hkv, d, dtype, device):
    """q, k as the model gets them: views of one fused qkv projection output."""
    qkv = _randn(gen, T, (hq + 2 * hkv) * d, dtype=dtype, device=device, scale=2.0)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(T, hq, d), k.view(T, hkv, d)


def assert_equal(got, want, what=""):
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    diff = int((got != want).sum())
    assert torch.equal(got, want), f"{what}: {diff} of {want.numel()} entries differ"


# ------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("T", TOKENS)
def test_rms_norm(T, n, dtype, gen, device):
    x = _randn(gen, T, n, dtype=dtype, device=device, scale=3.0)
    w = _norm_weight(gen, n, dtype, device)
    assert_equal(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("T", TOKENS)
def test_add_rms_norm(T, n, dtype, gen, device):
    x = _randn(gen, T, n, dtype=dtype, device=device)
    residual = _randn(gen, T, n, dtype=dtype, device=device, scale=4.0)
    w = _norm_weight(gen, n, dtype, device)
    normed, new_residual = add_rms_norm_triton(x, residual, w, 1e-6)
    normed_ref, new_residual_ref = add_rms_norm_ref(x, residual, w, 1e-6)
    assert_equal(new_residual, new_residual_ref, "residual")
    assert_equal(normed, normed_ref, "normed")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_rms_norm_of_head_views(d, dtype, gen, device):
    """Qwen3's q/k norm: [T, H, d] views of the qkv output (strided tokens and heads)."""
    q, _ = _qk_views(gen, 5, 9, 3, d, dtype, device)
    w = _norm_weight(gen, d, dtype, device)
    assert_equal(rms_norm_triton(q, w, 1e-6), rms_norm_ref(q, w, 1e-6))


def test_rms_norm_mixed_dtypes_promote_like_torch(gen, device):
    x = _randn(gen, 3, 96, dtype=torch.bfloat16, device=device)
    w = _norm_weight(gen, 96, torch.float32, device)
    assert_equal(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))


def _aten_cuda_mean(h: np.ndarray) -> np.ndarray:
    """ATen's CUDA `mean` over the last dim of a contiguous float32 [R, N], step by step as
    Reduce.cuh runs it (setReduceConfig, thread_reduce with vt0 = 4, block_x_reduce,
    block_y_reduce, MeanOps), written out independently of the kernel's plan."""
    R, N = h.shape
    f32 = np.float32
    last_pow2 = lambda v: 1 << (max(int(v), 1).bit_length() - 1)  # noqa: E731
    vectorize = N >= 128
    dim0 = N // 4 if vectorize else N
    dim0_pow2 = last_pow2(dim0) if dim0 < 512 else 512
    dim1_pow2 = last_pow2(R) if R < 512 else 512
    block_width = min(dim0_pow2, 32)
    block_height = min(dim1_pow2, 512 // block_width)
    block_width = min(dim0_pow2, 512 // block_height)
    step_input, input_mult = block_width, [1, 0]
    if math.ceil(N / step_input) >= min(block_height * 16, 256):
        input_mult[1] = step_input
        step_input *= block_height
        assert math.ceil(N / step_input) < 256, "global (multi-block) reduction: not emulated"
    warps = block_height if input_mult[1] else 1
    factor = f32(R) / f32(R * N)
    out = np.empty(R, dtype=f32)
    for r in range(R):
        row = h[r]
        value = np.zeros((warps, block_width), dtype=f32)
        for y in range(warps):
            for x in range(block_width):
                acc = [f32(0)] * 4
                idx = x * input_mult[0] + y * input_mult[1]
                if vectorize:  # input_vectorized_thread_reduce_impl (aligned rows, N % 4 == 0)
                    while idx * 4 + 3 < N:
                        for i in range(4):
                            acc[i] = f32(acc[i] + row[idx * 4 + i])
                        idx += step_input
                else:  # thread_reduce_impl
                    while idx + 3 * step_input < N:
                        for i in range(4):
                            acc[i] = f32(acc[i] + row[idx + i * step_input])
                        idx += 4 * step_input
                    for i in range(4):
                        if idx >= N:
                            break
                        acc[i] = f32(acc[i] + row[idx])
                        idx += step_input
                value[y, x] = f32(f32(f32(acc[0] + acc[1]) + acc[2]) + acc[3])
        dim_x = block_width
        if dim_x > 32:  # shared memory, then warp shuffles with decreasing offsets
            offset = dim_x // 2
            while offset >= 32:
                value[:, :offset] = value[:, :offset] + value[:, offset: 2 * offset]
                offset //= 2
            dim_x = 32
        offset = dim_x // 2
        while offset > 0:
            value[:, : dim_x - offset] = value[:, : dim_x - offset] + value[:, offset:dim_x]
            offset //= 2
        column = value[:, 0].copy()
        offset = warps // 2
        while offset > 0:  # block_y_reduce
            column[:offset] = column[:offset] + column[offset: 2 * offset]
            offset //= 2
        out[r] = f32(column[0] * factor)
    return out


# (N, rows): every block shape ATen picks for N = 4096 (rows 1, 2-3, 4-7, 8-15, >= 16),
# the unvectorized path (N < 128), and rows split across warps too (N = 8192, rows >= 16).
CUDA_PLANS = [(4096, 1), (4096, 3), (4096, 4), (4096, 8), (4096, 16), (576, 1), (576, 17), (96, 3), (64, 20),
              (128, 2), (16, 40), (8192, 16)]


@pytest.mark.parametrize("n,rows", CUDA_PLANS, ids=[f"n{n}-r{r}" for n, r in CUDA_PLANS])
def test_cuda_sum_order(n, rows, gen, device):
    """On CPU: the kernel told to sum in ATen's CUDA order equals the emulation of it. On
    CUDA: the emulation equals torch's own `mean` (what makes the kernel exact there)."""
    x = _randn(gen, rows, n, dtype=torch.float32, device=device, scale=2.0)
    h = x.pow(2)
    mean = torch.from_numpy(_aten_cuda_mean(h.cpu().numpy()))[:, None]
    if device == "cuda":
        assert_equal(mean, h.mean(-1, keepdim=True).cpu(), "mean")
        return
    w = _norm_weight(gen, n, torch.float32, device)
    assert_equal(rms_norm_triton(x, w, 1e-5, sum_order="cuda"), w * (x * torch.rsqrt(mean + 1e-5)))


def test_rms_norm_rejects_bad_shapes(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(4, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_triton(x, torch.zeros(2, 8, dtype=torch.float64, device=device), torch.ones(8, device=device),
                            1e-5)


# -------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("T", TOKENS)
def test_rotary_qk(T, heads, d, dtype, gen, device):
    q, k = _qk_views(gen, T, *heads, d, dtype, device)
    assert T == 1 or q.stride(0) == k.stride(0) == (heads[0] + 2 * heads[1]) * d  # the fused qkv's
    cos, sin = _cos_sin(gen, T, d, dtype, device)
    q_ref, k_ref = rotary_qk_ref(q, k, cos, sin)
    q_out, k_out = rotary_qk_triton(q, k, cos, sin)
    assert_equal(q_out, q_ref, "q")
    assert_equal(k_out, k_ref, "k")


# ------------------------------------------------------------------------ SiLU-mul


def _silu_mul_numpy_exp(gate_up: torch.Tensor) -> torch.Tensor:
    """torch's silu-mul rounding sequence with numpy's float32 exp, the interpreter's."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    g = gate.numpy()
    silu = torch.from_numpy(g / (np.float32(1) + np.exp(-g)))
    return (silu.to(gate_up.dtype) * up.to(gate_up.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1536])
@pytest.mark.parametrize("T", TOKENS)
def test_silu_mul(T, inter, dtype, gen, device):
    gate_up = _randn(gen, T, 2 * inter, dtype=dtype, device=device, scale=3.0)
    out = silu_mul_triton(gate_up)
    if device == "cpu" and dtype == torch.float32:
        # numpy's exp (the interpreter's) and torch's CPU one (SLEEF) differ in the last
        # bit: check the rest of the rounding sequence with numpy's.
        assert_equal(out, _silu_mul_numpy_exp(gate_up))
    else:
        assert_equal(out, silu_mul_ref(gate_up))


@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("T", [1, 17])
def test_silu_mul_reads_interleaved_features_in_place(T, group, gen, device):
    """gate_up's features interleaved (`cuda_linear.interleave_gate_up`'s layout: blocks of
    `group` gate features, then their up features) give the plain layout's output, bit for
    bit, with no de-interleaved copy made first."""
    from sparseengine.kernels.cuda_linear import interleave_gate_up

    plain = _randn(gen, T, 2 * 96, dtype=torch.bfloat16, device=device, scale=3.0)
    mixed = interleave_gate_up(plain.T, group).T.contiguous()
    assert not torch.equal(mixed, plain)
    assert_equal(silu_mul_triton(mixed, group), silu_mul_triton(plain), "silu_mul interleaved")
    assert_equal(silu_mul_ref(mixed, group), silu_mul_ref(plain), "silu_mul_ref interleaved")


@pytest.mark.parametrize("group", [-1, 5, 2.0, True])
def test_silu_mul_rejects_a_bad_group(group):
    gate_up = torch.zeros(2, 32)
    for fn in (silu_mul_ref, silu_mul_triton):
        with pytest.raises(ValueError, match="group must be"):
            fn(gate_up, group)


# ------------------------------------------------------------------------- model


def _plain_attention(self, q, k, v, cos, sin):
    """Causal softmax attention over this call's tokens, in place of the paged layer (its
    rotary embedding still `fused_ops.rotary_qk`)."""
    q, k = fused_ops.rotary_qk(q, k, cos, sin)
    g = self.num_heads // self.num_kv_heads
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("thd,shd->hts", q.float(), k.float()) / math.sqrt(self.head_dim)
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v.float()).to(q.dtype)


def _tiny_model(shape, dtype, device):
    from sparseengine.models import loader
    from sparseengine.models.llama import LlamaForCausalLM

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = LlamaForCausalLM(loader.resolve(shape, "dummy").model_config).to(device)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fill = torch.rand(p.shape, generator=gen) * 0.4 + 0.8 if "norm" in name else \
                torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(fill)
    model.rotary.inv_freq = model.rotary.inv_freq.float()
    return model.eval()


def _forward_pair(shape, dtype, device, ops, monkeypatch):
    from sparseengine.layers.attention import Attention

    monkeypatch.setattr(Attention, "forward", _plain_attention)
    model = _tiny_model(shape, dtype, device)
    ids = torch.randint(3, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(1)).to(device)
    positions = torch.arange(100, 107, device=device)
    with torch.no_grad():
        with fused_ops.forced(False):
            plain = model(ids, positions)
        with fused_ops.forced(True, ops):
            fused = model(ids, positions)
    return fused, plain


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3"])
def test_model_forward_float32(shape, device, monkeypatch):
    """Norms (with the residual adds) and rotary fused; on CPU SiLU-mul stays torch's (exp)."""
    ops = fused_ops.OPS if device == "cuda" else ("rms_norm", "rotary_qk")
    fused, plain = _forward_pair(shape, torch.float32, device, ops, monkeypatch)
    assert_equal(fused, plain, "hidden states")


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3"])
def test_model_forward_bfloat16(shape, device, monkeypatch):
    fused, plain = _forward_pair(shape, torch.bfloat16, device, fused_ops.OPS, monkeypatch)
    assert_equal(fused, plain, "hidden states")


def test_forced_names_valid_ops():
    with pytest.raises(ValueError, match="rms_norm"):
        with fused_ops.forced(True, ("layernorm",)):
            pass


def test_cpu_tensors_take_the_torch_path(gen):
    x = torch.randn(3, 96, generator=gen)
    w = torch.ones(96)
    assert_equal(fused_ops.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    assert not fused_ops._fused("rms_norm", x)
    with fused_ops.forced(True, ("rms_norm",)):
        assert fused_ops._fused("rms_norm", x) and not fused_ops._fused("silu_mul", x)
    assert not fused_ops._fused("rms_norm", x)


# -------------------------------------------------------------------- GPU, bf16


@pytest.mark.gpu
@pytest.mark.parametrize("n,T", [(4096, 1), (4096, 2), (4096, 5), (4096, 8), (4096, 16), (4096, 300),
                                 (8192, 32), (576, 7), (2048, 64)])
def test_gpu_add_rms_norm_llama_shapes(n, T, gen):
    x = _randn(gen, T, n, dtype=torch.bfloat16, device="cuda")
    residual = _randn(gen, T, n, dtype=torch.bfloat16, device="cuda", scale=8.0)
    w = _norm_weight(gen, n, torch.bfloat16, "cuda")
    assert_equal(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), "rms_norm")
    for got, want in zip(add_rms_norm_triton(x, residual, w, 1e-5), add_rms_norm_ref(x, residual, w, 1e-5)):
        assert_equal(got, want, "add_rms_norm")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16, 128])
def test_gpu_rotary_and_silu_llama_shapes(T, gen):
    q, k = _qk_views(gen, T, 32, 8, 128, torch.bfloat16, "cuda")
    cos, sin = _cos_sin(gen, T, 128, torch.bfloat16, "cuda")
    for got, want in zip(rotary_qk_triton(q, k, cos, sin), rotary_qk_ref(q, k, cos, sin)):
        assert_equal(got, want, "rotary")
    gate_up = _randn(gen, T, 2 * 14336, dtype=torch.bfloat16, device="cuda", scale=3.0)
    assert_equal(silu_mul_triton(gate_up), silu_mul_ref(gate_up), "silu_mul")


@pytest.mark.gpu
def test_gpu_model_forward_under_cuda_graph(monkeypatch):
    """The fused ops capture in a CUDA graph and replay to the same hidden states."""
    from sparseengine.layers.attention import Attention

    monkeypatch.setattr(Attention, "forward", _plain_attention)
    model = _tiny_model("tiny-llama", torch.bfloat16, "cuda")
    ids = torch.randint(3, 500, (4,), device="cuda")
    positions = torch.arange(4, device="cuda")
    with torch.no_grad():
        with fused_ops.forced(False):
            plain = model(ids, positions)
        eager = model(ids, positions)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(ids, positions)
        graph.replay()
    torch.cuda.synchronize()
    assert_equal(eager, plain, "eager")
    assert_equal(captured, plain, "graph")
