"""`skinny_linear_triton` against `F.linear` on fresh random inputs: few rows (a decode
batch) and more than one row block, ragged N and K (the masked loads), a bias, bf16 and
float32, the programmatic-dependent-launch path (first weight tile before the wait), the
RMSNorm folded in (`rms_eps`) and the residual added (`residual`), and the errors for
bad input. On the GPU also the Llama-3.1-8B layer shapes. (The model with its norms folded
is checked against Hugging Face on the GPU in tests/test_hf_equivalence.py.)"""
import pytest
import torch
import torch.nn.functional as F

from sparseengine.kernels import skinny_linear_ref, skinny_linear_triton


def _inputs(gen, device, M, N, K, dtype, bias):
    x = torch.randn(M, K, generator=gen).to(dtype).to(device)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(device)
    b = torch.randn(N, generator=gen).to(dtype).to(device) if bias else None
    return x, w, b


def _check(y, x, w, b, eps=None, res=None, operand_ulps=0):
    """Within float32 rounding of the exact product of the same inputs (with `eps`, of
    RMSNorm(x) with a unit weight, computed in float64), plus the output's own rounding
    (one ulp of its dtype: the interpreter truncates float32 to bf16, the GPU rounds),
    `operand_ulps` ulps a term (the model's norm rounds the scaled x; the kernel scales
    after the dot, so 0 for it) and, with a residual `res`, the add's rounding."""
    xd = x.double()
    if eps is not None:
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    want = F.linear(xd, w.double(), None if b is None else b.double())
    bound = F.linear(xd.abs(), w.double().abs(), None if b is None else b.double().abs())
    ulp = torch.finfo(y.dtype).eps  # bf16 2^-7, fp16 2^-10, fp32 2^-23
    tol = (1e-5 + operand_ulps * ulp) * bound + ulp * want.abs() + 1e-30
    if res is not None:
        want = want + res.double()
        tol = tol + ulp * want.abs()
    assert y.shape == want.shape and y.dtype == x.dtype
    err = (y.double() - want).abs()
    assert bool((err <= tol).all()), f"max err {err.max().item():.3g}, tol there {tol.flatten()[err.argmax()]:.3g}"


@pytest.mark.parametrize("M,N,K,bias,dtype,block_n,block_k", [
    (1, 64, 256, False, torch.bfloat16, 16, 64),
    (6, 96, 384, True, torch.bfloat16, 32, 128),   # N, K multiples of the blocks: unmasked weight loads
    (6, 50, 200, False, torch.bfloat16, 16, 64),   # neither: masked
    (16, 48, 100, True, torch.float32, 16, 32),
    (21, 40, 70, False, torch.float32, 32, 32),    # two row blocks, the second partial
])
@pytest.mark.parametrize("pdl", [False, True])
def test_matches_linear(gen, device, M, N, K, bias, dtype, block_n, block_k, pdl):
    x, w, b = _inputs(gen, device, M, N, K, dtype, bias)
    y = skinny_linear_triton(x, w, b, block_n=block_n, block_k=block_k, pdl=pdl)
    _check(y, x, w, b)
    if pdl:  # the same sums in the same order as the plain launch
        assert torch.equal(y, skinny_linear_triton(x, w, b, block_n=block_n, block_k=block_k))


@pytest.mark.parametrize("M,block_m", [(20, 32), (32, 32), (40, 32), (5, 32)])
def test_row_blocks_of_32(gen, device, M, block_m):
    """Rows in blocks of 32 (the engine's tiles above 16 rows): one block up to 32 rows,
    the weight read once; a second, partial block past it; padding rows below it."""
    x, w, b = _inputs(gen, device, M, 48, 100, torch.float32, True)
    _check(skinny_linear_triton(x, w, b, block_n=16, block_k=32, block_m=block_m), x, w, b)
    _check(skinny_linear_triton(x, w, b, block_n=16, block_k=32, block_m=block_m, rms_eps=1e-5,
                                residual=torch.ones(M, 48, device=device)),
           x, w, b, eps=1e-5, res=torch.ones(M, 48, device=device))
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        skinny_linear_triton(x, w, b, block_m=24)


@pytest.mark.parametrize("M,N,K,bias,dtype,block_n,block_k", [
    (6, 96, 384, True, torch.bfloat16, 32, 128),
    (6, 50, 200, False, torch.bfloat16, 16, 64),   # masked: padded channels must not count in the mean
    (16, 48, 100, True, torch.float32, 16, 32),
    (21, 40, 70, False, torch.float32, 32, 32),    # two row blocks
])
@pytest.mark.parametrize("norm,residual", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("pdl", [False, True])
def test_folded_norm_and_residual(gen, device, M, N, K, bias, dtype, block_n, block_k, norm, residual, pdl):
    x, w, b = _inputs(gen, device, M, N, K, dtype, bias)
    x = x * 3 + 0.5  # rows whose rms is not 1
    res = torch.randn(M, N, generator=gen).to(dtype).to(device) if residual else None
    eps = 1e-5 if norm else None
    y = skinny_linear_triton(x, w, b, rms_eps=eps, residual=res, block_n=block_n, block_k=block_k, pdl=pdl)
    if norm:
        _check(y, x, w, b, eps, res, operand_ulps=0)
        ref = skinny_linear_ref(x, w, b, rms_eps=eps, residual=res)  # the model's unfolded ops
        _check(ref, x, w, b, eps, res, operand_ulps=1)
    else:  # the unfused kernel's output then torch's add: bit for bit where Triton rounds (the
        # GPU); the interpreter truncates float32 to bf16, so within an ulp there
        want = skinny_linear_triton(x, w, b, block_n=block_n, block_k=block_k) + res
        if y.is_cuda:
            assert torch.equal(y, want)
        else:
            ulp = torch.finfo(dtype).eps
            assert bool(((y.double() - want.double()).abs() <= ulp * want.double().abs()).all())


@pytest.mark.parametrize("M,N,K,bias,dtype,block_n,block_k", [
    (6, 96, 384, True, torch.bfloat16, 32, 128),   # whole tiles
    (6, 50, 200, False, torch.bfloat16, 16, 64),   # rows and channels past the weight: zeros
    (16, 100, 96, False, torch.float32, 16, 32),   # a partial last tile of features
    (21, 40, 72, True, torch.float32, 32, 32),     # two row blocks; channels past K in the last tile
])
@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
def test_tma_loads(gen, device, M, N, K, bias, dtype, block_n, block_k, folded, pdl):
    """The weight's tiles through a tensor descriptor (`tma`): the plain loads' result, bit
    for bit (the same tiles into the same sums); with the norm and residual folded in, and
    the PDL path's first tile."""
    x, w, b = _inputs(gen, device, M, N, K, dtype, bias)
    res = torch.randn(M, N, generator=gen).to(dtype).to(device) if folded else None
    kw = dict(rms_eps=1e-5 if folded else None, residual=res, block_n=block_n, block_k=block_k, pdl=pdl)
    y = skinny_linear_triton(x, w, b, tma=True, **kw)
    assert torch.equal(y, skinny_linear_triton(x, w, b, **kw))
    _check(y, x, w, b, kw["rms_eps"], res)


def test_tma_needs_aligned_rows(device):
    w = torch.zeros(16, 70, device=device)[:, :68]  # rows of 280 bytes: not a multiple of 16
    with pytest.raises(ValueError, match="tma needs 16-byte aligned weight rows, got .* rows of 280 bytes"):
        skinny_linear_triton(torch.zeros(2, 68, device=device), w, tma=True)


def test_folded_bad_input(device):
    x = torch.zeros(2, 64, device=device)
    w = torch.zeros(16, 64, device=device)
    with pytest.raises(ValueError, match="rms_eps must be a number >= 0 or None, got -1"):
        skinny_linear_triton(x, w, rms_eps=-1)
    with pytest.raises(ValueError, match=r"residual must be \(2, 16\) in torch.float32"):
        skinny_linear_triton(x, w, residual=torch.zeros(2, 8, device=device))
    with pytest.raises(ValueError, match=r"residual must be \(2, 16\) in torch.float32"):
        skinny_linear_triton(x, w, residual=torch.zeros(2, 16, device=device, dtype=torch.bfloat16))


def test_model_linear_folds_norm_and_residual(gen, device):
    """The model's `Linear` with `norm` (a unit-weight RMSNorm) and `residual`: the Triton
    kernel on a GPU's few rows, the norm, cuBLAS/torch's linear and the add otherwise."""
    from sparseengine.layers.layernorm import RMSNorm
    from sparseengine.layers.linear import Linear

    layer = Linear(64, 48, bias=True).to(device)
    norm = RMSNorm(64, 1e-5).to(device)
    x = torch.randn(5, 64, generator=gen).to(device) * 2 + 1
    res = torch.randn(5, 48, generator=gen).to(device)
    with torch.no_grad():
        y = layer(x, norm, res)
        _check(y, x, layer.weight, layer.bias, 1e-5, res, operand_ulps=1)
        if not x.is_cuda:  # the plain ops, exactly
            assert torch.equal(y, F.linear(norm(x), layer.weight, layer.bias) + res)


def test_leading_dims_and_strided_input(gen, device):
    x, w, _ = _inputs(gen, device, 12, 32, 64, torch.float32, False)
    x3 = x.view(3, 4, 64)
    y = skinny_linear_triton(x3, w, block_k=32)
    assert y.shape == (3, 4, 32)
    _check(y.view(12, 32), x, w, None)
    wide = torch.randn(5, 128, generator=gen).to(device)[:, ::2]  # rows of 64, stride 2
    _check(skinny_linear_triton(wide, w, block_k=32), wide.contiguous(), w, None)


def test_reference_is_linear(gen, device):
    x, w, b = _inputs(gen, device, 3, 8, 16, torch.float32, True)
    assert torch.equal(skinny_linear_ref(x, w, b), F.linear(x, w, b))


def test_bad_input(device):
    x = torch.zeros(2, 64, device=device)
    w = torch.zeros(16, 64, device=device)
    with pytest.raises(ValueError, match="x must end in K=64"):
        skinny_linear_triton(torch.zeros(2, 32, device=device), w)
    with pytest.raises(ValueError, match=r"weight must be a \[N, K\] tensor"):
        skinny_linear_triton(x, w[0])
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_linear_triton(x.bfloat16(), w)
    with pytest.raises(ValueError, match=r"bias must be \[N=16\]"):
        skinny_linear_triton(x, w, torch.zeros(8, device=device))
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16, got 48"):
        skinny_linear_triton(x, w, block_k=48)
    with pytest.raises(ValueError, match="block_n must be an integer >= 16, got 8"):
        skinny_linear_triton(x, w, block_n=8)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("pdl", [False, True])
def test_llama_shapes_on_gpu(gen, N, K, pdl):
    x, w, _ = _inputs(gen, "cuda", 6, N, K, torch.bfloat16, False)
    y = skinny_linear_triton(x, w, block_n=32, block_k=256, num_stages=3, pdl=pdl)
    _check(y, x, w, None)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 17, 32, 33])
def test_model_linear_on_gpu(gen, rows):
    """The model's `Linear`: the Triton kernel with its layer's tiles up to ENGINE_MAX_ROWS
    rows, cuBLAS above."""
    from sparseengine.kernels import skinny_linear
    from sparseengine.layers.linear import Linear

    layer = Linear(256, 96, bias=True).cuda().bfloat16()
    x = torch.randn(rows, 256, generator=gen).bfloat16().cuda()
    with torch.no_grad():
        y = layer(x)
        _check(y, x, layer.weight, layer.bias)
        if rows <= skinny_linear.ENGINE_MAX_ROWS:
            want = skinny_linear_triton(x, layer.weight, layer.bias,
                                        **skinny_linear.engine_tiles(96, x.dtype, x.device, rows))
        else:
            want = F.linear(x, layer.weight, layer.bias)
        assert torch.equal(y, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_model_linear_wide_layer_every_dtype_on_gpu(gen, dtype):
    """The engine's tiles fit the shared memory at a wide layer (Llama-3.1-8B's qkv) in every
    dtype a model may load in."""
    from sparseengine.layers.linear import Linear

    layer = Linear(4096, 6144, bias=False).cuda().to(dtype)
    for rows in (6, 32):  # row blocks of 16 and of 32
        x = torch.randn(rows, 4096, generator=gen).to(dtype).cuda()
        with torch.no_grad():
            _check(layer(x), x, layer.weight, None)



def test_engine_tiles_by_rows():
    """16 rows a block up to 16, 32 above (4 stages: 5 would overflow the shared memory);
    TMA loads on a GPU, but not in the 4096-wide layers above 16 rows (slower there)."""
    from sparseengine.kernels.skinny_linear import engine_tiles

    gpu = torch.device("cuda")
    assert engine_tiles(6144, torch.bfloat16, gpu, 6) == dict(block_n=64, block_k=256, num_warps=4, num_stages=5,
                                                              tma=True)
    assert engine_tiles(4096, torch.bfloat16, gpu, 6)["tma"]
    wide, narrow = engine_tiles(28672, torch.bfloat16, gpu, 20), engine_tiles(4096, torch.bfloat16, gpu, 20)
    assert wide["block_m"] == narrow["block_m"] == 32 and wide["num_stages"] == narrow["num_stages"] == 4
    assert wide["tma"] and "tma" not in narrow
    assert "block_m" not in engine_tiles(4096, torch.float32, None, 16)
