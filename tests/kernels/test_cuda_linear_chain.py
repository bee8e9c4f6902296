"""`cuda_linear_chain` (a decode layer's o projection and MLP in one launch, grid barriers
between the linears) against the three `cuda_linear` launches it replaces, bit for bit, on
fresh random inputs: the benchmark's layer shapes at 1-8 rows, x staged or not, as a PDL
launch or not, in a CUDA graph replayed many times (the barrier's counters left as found),
in the builds whose grid holds several CTAs an SM; the engine's tokens with it on and off
(tests/test_decode_linears.py). On the CPU: the errors for bad input and when the model
takes it. Its registers (no spills, the chain's kernels among the build's): test_nvcc_build."""
import pytest
import torch

from sparseengine.kernels import cuda_linear as C
from sparseengine.kernels import cuda_linear_chain as CH

BF16 = torch.bfloat16


def _weights(gen, n, k, i, device="cpu"):
    def w(rows, cols):
        return (torch.randn(rows, cols, generator=gen) / cols ** 0.5).to(BF16).to(device)
    return w(n, k), C.interleave_gate_up(w(2 * i, n)), w(n, i)


def test_bad_input():
    gen = torch.Generator().manual_seed(0)
    w_o, w_up, w_down = _weights(gen, 2048, 2048, 2048)
    a, r = torch.zeros(3, 2048, dtype=BF16), torch.zeros(3, 2048, dtype=BF16)
    with pytest.raises(ValueError, match=r"needs w_o \[N, K\], w_up \[2 I, N\], w_down \[N, I\]"):
        CH.o_and_mlp(a, r, w_o, w_up, w_down[:, :1024], 1e-5)
    with pytest.raises(ValueError, match=r"needs w_o \[N, K\], w_up \[2 I, N\]"):
        CH.o_and_mlp(a, r, w_o, w_up[:, :1024].contiguous(), w_down, 1e-5)
    with pytest.raises(ValueError, match="N and I multiples of 2048"):
        CH.o_and_mlp(a, r[:, :16], w_o[:16], torch.zeros(2048, 16, dtype=BF16), torch.zeros(16, 1024, dtype=BF16),
                     1e-5)
    with pytest.raises(ValueError, match=r"residual must be \(3, 2048\)"):
        CH.o_and_mlp(a, r[:2], w_o, w_up, w_down, 1e-5)
    with pytest.raises(ValueError, match="rms_eps must be a number >= 0"):
        CH.o_and_mlp(a, r, w_o, w_up, w_down, None)
    with pytest.raises(ValueError, match="w_down must be a bf16"):
        CH.o_and_mlp(a, r, w_o, w_up, w_down.float(), 1e-5)
    with pytest.raises(ValueError, match="takes 1 to 8 rows, got 9"):
        CH.o_and_mlp(torch.zeros(9, 2048, dtype=BF16), torch.zeros(9, 2048, dtype=BF16), w_o, w_up, w_down, 1e-5)
    with pytest.raises(RuntimeError, match="cannot run: needs a CUDA device, got cpu"):
        CH.o_and_mlp(a, r, w_o, w_up, w_down, 1e-5)


def test_the_model_takes_it_only_when_on(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    w_o, w_up, w_down = _weights(gen, 2048, 2048, 2048)
    a = torch.zeros(3, 2048, dtype=BF16)
    assert not CH.ENGINE and not CH.takes(a, w_o, w_up, w_down)  # off until a GPU has run it
    monkeypatch.setattr(CH, "ENGINE", True)
    assert not CH.takes(a, w_o, w_up, w_down)  # on the CPU: cuda_linear does not run


# ---------------------------------------------------------------------------- on the GPU


def _gpu():
    reason = C.unavailable("cuda")
    assert reason is None, reason


def _case(gen, rows, n, k, i):
    w_o, w_up, w_down = _weights(gen, n, k, i, "cuda")
    a = torch.randn(rows, k, generator=gen).to(BF16).cuda()
    r = (torch.randn(rows, n, generator=gen) * 2).to(BF16).cuda()
    return a, r, w_o, w_up, w_down


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 6, 8])
@pytest.mark.parametrize("n,k,i", [(4096, 4096, 14336), (2048, 2048, 4096)])
def test_the_three_launches_bits(gen, rows, n, k, i):
    _gpu()
    a, r, w_o, w_up, w_down = _case(gen, rows, n, k, i)
    want = CH.o_and_mlp_ref(a, r, w_o, w_up, w_down, 1e-5)
    for staged in (False, True):
        for pdl in (False, True):
            got = CH.o_and_mlp(a, r, w_o, w_up, w_down, 1e-5, staged=staged, pdl=pdl)
            assert torch.equal(got, want), (staged, pdl)


@pytest.mark.gpu
def test_replayed_in_a_cuda_graph_and_launched_again(gen):
    """The barrier's counters come back to zero arrivals after every launch, so a graph of
    several chains replays, eager launches between replays, and each gives the eager bits."""
    _gpu()
    a, r, w_o, w_up, w_down = _case(gen, 6, 4096, 4096, 14336)
    want = CH.o_and_mlp_ref(a, r, w_o, w_up, w_down, 1e-5)

    def chain():  # each feeds the next, as layers do
        h = r
        for _ in range(3):
            h = CH.o_and_mlp(a, h, w_o, w_up, w_down, 1e-5)
        return h

    def chain_ref():
        h = r
        for _ in range(3):
            h = CH.o_and_mlp_ref(a, h, w_o, w_up, w_down, 1e-5)
        return h
    deep = chain_ref()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    bar = CH._BARRIERS[torch.cuda.current_device()]
    gen0 = int(bar[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    for _ in range(50):
        graph.replay()
        assert torch.equal(CH.o_and_mlp(a, r, w_o, w_up, w_down, 1e-5), want)
    torch.cuda.synchronize()
    assert torch.equal(got, deep)
    assert int(bar[0]) == 0 and int(bar[1]) - gen0 == 2 * 50 * (3 + 1)  # two barriers a launch


@pytest.mark.gpu
@pytest.mark.parametrize("warps,ctas", [(8, 2), (4, 4)])
def test_grids_of_several_ctas_an_sm(gen, monkeypatch, warps, ctas):
    _gpu()
    monkeypatch.setattr(C, "BUILD_WARPS", warps)
    monkeypatch.setattr(C, "BUILD_MIN_CTAS", ctas)
    monkeypatch.setattr(C, "BUILD_GRID_CTAS", ctas)
    a, r, w_o, w_up, w_down = _case(gen, 6, 4096, 4096, 14336)
    assert torch.equal(CH.o_and_mlp(a, r, w_o, w_up, w_down, 1e-5), CH.o_and_mlp_ref(a, r, w_o, w_up, w_down, 1e-5))
