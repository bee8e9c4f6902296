"""`cuda_linear` (the decode step's linears in CUDA) against the torch oracle on fresh random
inputs: plain, with the RMSNorm and the residual folded in, and gated (SiLU-and-multiply
of an interleaved gate_up); x from L2 or staged in shared memory; launched as a
programmatic dependent launch or not, alone and chained in a CUDA graph; the Llama-3.1-8B
layer shapes. On the CPU: the gate_up interleave's layout and the errors for bad input
(checked before the device is). The model with it: tests/test_decode_linears.py."""
import pytest
import torch

from sparseengine.kernels import cuda_linear as C
from sparseengine.kernels.fused_ops import silu_mul_triton
from sparseengine.kernels.nvcc_build import find_nvcc

BF16 = torch.bfloat16


def test_interleave_layout():
    """Groups of 8 gate rows, then the same features' 8 up rows; the output goes back in order."""
    w = torch.arange(64 * 3, dtype=torch.float32).reshape(64, 3)  # 2I = 64: gate rows 0-31, up rows 32-63
    wi = C.interleave_gate_up(w)
    for j in range(4):
        assert torch.equal(wi[16 * j:16 * j + 8], w[8 * j:8 * j + 8])
        assert torch.equal(wi[16 * j + 8:16 * j + 16], w[32 + 8 * j:32 + 8 * j + 8])
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(C.deinterleave_gate_up(x @ wi.T), x @ w.T)
    with pytest.raises(ValueError, match="must be a multiple of 2 x group=8"):
        C.interleave_gate_up(torch.zeros(24, 3))


def test_bad_input():
    x, w = torch.zeros(2, 2048, dtype=BF16), torch.zeros(16, 2048, dtype=BF16)
    with pytest.raises(ValueError, match="takes bf16 x and weight, got torch.float32"):
        C.cuda_linear(x.float(), w)
    with pytest.raises(ValueError, match="takes 1 to 8 rows, got 9"):
        C.cuda_linear(torch.zeros(9, 2048, dtype=BF16), w)
    with pytest.raises(ValueError, match="N a multiple of 16 and K of 2048, got N=16, K=1024"):
        C.cuda_linear(torch.zeros(2, 1024, dtype=BF16), torch.zeros(16, 1024, dtype=BF16))
    with pytest.raises(ValueError, match="gated takes no residual"):
        C.cuda_linear(x, w, gated=True, residual=torch.zeros(2, 16, dtype=BF16))
    with pytest.raises(ValueError, match=r"residual must be \(2, 16\)"):
        C.cuda_linear(x, w, residual=torch.zeros(2, 8, dtype=BF16))
    with pytest.raises(ValueError, match="rms_eps must be a number >= 0"):
        C.cuda_linear(x, w, rms_eps=-1.0)
    with pytest.raises(ValueError, match="x must end in K=2048"):
        C.cuda_linear(torch.zeros(2, 4096, dtype=BF16), w)
    with pytest.raises(RuntimeError, match="cannot run: needs a CUDA device, got cpu"):
        C.cuda_linear(x, w)
    assert not C.takes(x, w) and C.fits(w) and not C.fits(w, bias=torch.zeros(16, dtype=BF16))


def test_build_variants(monkeypatch):
    """The build's constants name its K multiple, its nvcc flags and its own cached library;
    a build outside the kernel's range raises."""
    monkeypatch.setattr(C, "BUILD_STEPS", 2)
    assert C.k_multiple() == 1024
    w = torch.zeros(16, 1024, dtype=BF16)
    assert C.fits(w)
    with pytest.raises(ValueError, match="K of 1024, got N=16, K=1536"):
        C.cuda_linear(torch.zeros(2, 1536, dtype=BF16), torch.zeros(16, 1536, dtype=BF16))
    cmd = C.build_command("nvcc", "out.so", (16, 2, 2, 2))
    assert {"-DSE_WARPS=16", "-DSE_STEPS=2", "-DSE_MIN_CTAS=2", "-DSE_GRID_CTAS=2"} <= set(cmd)
    assert cmd[-1] == str(C.SOURCE)
    monkeypatch.setattr(C, "BUILD_MIN_CTAS", 5)
    with pytest.raises(ValueError, match=r"must be in .* got \(16, 2, 5, 1\)"):
        C.library()
    monkeypatch.setattr(C, "BUILD_MIN_CTAS", 1)
    monkeypatch.setattr(C, "BUILD_GRID_CTAS", 2)  # a grid not resident at once
    with pytest.raises(ValueError, match=r"\(1 .. min CTAs\), got \(16, 2, 1, 2\)"):
        C.library()


def test_the_bench_sets_a_build_for_a_block_only():
    """The chain bench's builds (`using_build`) hold inside their block and are undone after it,
    an error included, so the variants after one run the engine's build."""
    from sparseengine.kernels.bench_cuda_linear import GRID_BUILDS, using_build

    engine = C._build()
    for build in GRID_BUILDS.values():
        with using_build(build):
            assert C._build() == build and C.k_multiple() == build[0] * 32 * build[1]
        assert C._build() == engine
    with pytest.raises(ValueError, match="grid CTAs"), using_build((16, 4, 1, 2)):
        C.library()
    assert C._build() == engine


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (no GPU needed: the library loads without one)")
def test_a_variant_builds(monkeypatch, tmp_path):
    """Non-default builds (2 CTAs an SM, 2 steps; 8 warps in a grid of 2 CTAs an SM) compile,
    and each library reports the K multiple and grid the Python side expects of it."""
    monkeypatch.setenv("SPARSEENGINE_CACHE", str(tmp_path))
    so = C._library((16, 2, 2, 1))
    assert so.se_linear_k_multiple() == 1024 and so.se_linear_grid_ctas() == 1
    so = C._library((8, 4, 2, 2))
    assert so.se_linear_k_multiple() == 1024 and so.se_linear_grid_ctas() == 2
    assert len(list(tmp_path.glob("cuda/*/libse_linear.so"))) == 2


# ---------------------------------------------------------------------------- on the GPU


def _gpu():
    reason = C.unavailable("cuda")
    assert reason is None, reason  # the H200 runs it: a missing nvcc there is a failure, not a skip


def _inputs(gen, M, N, K, spread=1.0):
    x = (torch.randn(M, K, generator=gen) * spread + 0.3).to(BF16).cuda()
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(BF16).cuda()
    return x, w


def _check(y, x, w, eps=None, res=None, operand_ulps=0):
    """Within float32 rounding of the exact product (float64; with `eps`, of RMSNorm(x)),
    plus the output's rounding (an ulp of bf16), with a residual the add's too;
    `operand_ulps`: the model's norm rounds the scaled x (the kernel scales after the sum)."""
    xd = x.double()
    if eps is not None:
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    want = xd @ w.double().T
    bound = xd.abs() @ w.double().abs().T
    ulp = 2.0 ** -7
    tol = (1e-5 + operand_ulps * ulp) * bound + ulp * want.abs() + 1e-30
    if res is not None:
        want = want + res.double()
        tol = tol + ulp * want.abs()
    err = (y.double() - want).abs()
    assert bool((err <= tol).all()), f"max err {err.max().item():.3g}, tol there {tol.flatten()[err.argmax()]:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 6, 8])
@pytest.mark.parametrize("N,K", [(64, 2048), (48, 4096), (4096, 2048)])  # one block a CTA; several
@pytest.mark.parametrize("norm,residual", [(False, False), (True, False), (False, True), (True, True)])
def test_matches_the_exact_product(gen, M, N, K, norm, residual):
    _gpu()
    x, w = _inputs(gen, M, N, K, spread=3.0 if norm else 1.0)
    res = torch.randn(M, N, generator=gen).to(BF16).cuda() if residual else None
    eps = 1e-5 if norm else None
    y = C.cuda_linear(x, w, rms_eps=eps, residual=res, staged=False, pdl=False)
    _check(y, x, w, eps, res)
    for staged, pdl in ((True, False), (False, True), (True, True)):  # the same sums in the same order
        assert torch.equal(C.cuda_linear(x, w, rms_eps=eps, residual=res, staged=staged, pdl=pdl), y)
    if norm:  # the model's unfolded ops, within the norm's rounding of x
        _check(C.cuda_linear_ref(x, w, rms_eps=eps, residual=res), x, w, eps, res, operand_ulps=1)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 6, 8])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("staged", [False, True])
def test_gated_is_silu_mul_of_the_plain_product(gen, M, norm, staged):
    """gated = the SiLU-and-multiply kernel on the same launch's plain output, put back in
    order: bit for bit (the same sums, the same roundings); and near the torch oracle."""
    _gpu()
    x, w = _inputs(gen, M, 2 * 1024, 4096, spread=3.0 if norm else 1.0)
    w = w * 4  # gates spread over SiLU's curve
    wi = C.interleave_gate_up(w)
    eps = 1e-5 if norm else None
    h = C.cuda_linear(x, wi, rms_eps=eps, gated=True, staged=staged)
    assert h.shape == (M, 1024)
    plain = C.deinterleave_gate_up(C.cuda_linear(x, wi, rms_eps=eps, staged=staged))
    assert torch.equal(h, silu_mul_triton(plain))
    want = C.cuda_linear_ref(x, wi, rms_eps=eps, gated=True)
    assert ((h.float() - want.float()).abs() <= 0.02 * want.float().abs() + 0.02 * want.float().abs().max()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name,N,K", [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                                      ("down", 4096, 14336)])
def test_llama_8b_shapes(gen, name, N, K):
    """The benchmark's layers at 6 rows, with the folds each takes in the model."""
    _gpu()
    x, w = _inputs(gen, 6, N, K, spread=2.0)
    if name == "gate_up":
        wi = C.interleave_gate_up(w)
        h = C.cuda_linear(x, wi, rms_eps=1e-5, gated=True)
        assert torch.equal(h, silu_mul_triton(C.deinterleave_gate_up(C.cuda_linear(x, wi, rms_eps=1e-5))))
        _check(C.deinterleave_gate_up(C.cuda_linear(x, wi, rms_eps=1e-5)), x, w, 1e-5)
        return
    eps = 1e-5 if name == "qkv" else None
    res = None if name == "qkv" else torch.randn(6, N, generator=gen).to(BF16).cuda()
    _check(C.cuda_linear(x, w, rms_eps=eps, residual=res), x, w, eps, res)


@pytest.mark.gpu
@pytest.mark.parametrize("staged", [False, True])
def test_a_launch_is_deterministic(gen, staged):
    """The same inputs give the same bits, launch after launch: the folded norm's row sums
    of squares are summed over the warps in a fixed order. (Summed by atomics in the order
    the warps finished, one launch in a few dozen differed in its last bits, session 42.)"""
    _gpu()
    x, w = _inputs(gen, 8, 4096, 4096, spread=3.0)
    res = torch.randn(8, 4096, generator=gen).to(BF16).cuda()
    want = C.cuda_linear(x, w, rms_eps=1e-5, residual=res, staged=staged)
    for _ in range(200):
        assert torch.equal(C.cuda_linear(x, w, rms_eps=1e-5, residual=res, staged=staged), want)


@pytest.mark.gpu
def test_pdl_chain_in_a_cuda_graph(gen):
    """Programmatic dependent launches back to back in a CUDA graph (each reads the one
    before's output), as a decode step's graph holds them: the eager chain's result."""
    _gpu()
    x, w1 = _inputs(gen, 6, 4096, 2048)
    _, w2 = _inputs(gen, 6, 2048, 4096)
    _, w3 = _inputs(gen, 6, 2 * 2048, 2048)
    w3 = C.interleave_gate_up(w3)

    def chain():
        a = C.cuda_linear(x, w1, rms_eps=1e-5, pdl=True)
        b = C.cuda_linear(a, w2, residual=x, pdl=True)
        return C.cuda_linear(b, w3, rms_eps=1e-5, gated=True, pdl=True)

    want = chain()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("warps,ctas", [(8, 2), (4, 4)])
def test_grids_of_several_ctas_an_sm(gen, monkeypatch, warps, ctas):
    """Builds whose grid holds several CTAs an SM: the benchmark's layers within rounding of
    the exact product, and the same bits as the same warps in a grid of one CTA an SM (a
    block's sums do not depend on which CTA takes it)."""
    _gpu()
    monkeypatch.setattr(C, "BUILD_WARPS", warps)
    monkeypatch.setattr(C, "BUILD_MIN_CTAS", ctas)
    for N, K, eps, residual in ((6144, 4096, 1e-5, False), (4096, 4096, None, True), (4096, 14336, None, True)):
        x, w = _inputs(gen, 6, N, K, spread=2.0)
        res = torch.randn(6, N, generator=gen).to(BF16).cuda() if residual else None
        got = {}
        for grid in (ctas, 1):
            monkeypatch.setattr(C, "BUILD_GRID_CTAS", grid)
            got[grid] = C.cuda_linear(x, w, rms_eps=eps, residual=res)
        _check(got[ctas], x, w, eps, res)
        assert torch.equal(got[ctas], got[1])
    x, w = _inputs(gen, 6, 28672, 4096, spread=2.0)
    wi = C.interleave_gate_up(w)
    h = C.cuda_linear(x, wi, rms_eps=1e-5, gated=True)
    assert torch.equal(h, silu_mul_triton(C.deinterleave_gate_up(C.cuda_linear(x, wi, rms_eps=1e-5))))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_each_device_gets_its_own_launch_setup(gen):
    """The library keeps the SM count and the shared memory it allowed the kernel a device
    each: x on the second GPU while the first is current, staged (the larger allowance, set
    on the first GPU before), gives the first GPU's bits."""
    _gpu()
    x, w = _inputs(gen, 8, 4096, 4096, spread=3.0)
    want = C.cuda_linear(x, w, rms_eps=1e-5, staged=True)
    with torch.cuda.device(0):
        got = C.cuda_linear(x.to("cuda:1"), w.to("cuda:1"), rms_eps=1e-5, staged=True)
    assert got.device == torch.device("cuda", 1)
    assert torch.equal(got.cpu(), want.cpu())
