"""`row_argmax_triton` against `torch.argmax` (the first index of a row's maximum, a NaN
the largest) on fresh random rows: ties, NaNs, infinities, rows of -inf only, a row shorter
than a block and rows of many chunks; the counters left at zero (a second launch); a CUDA
graph on the GPU; the errors for bad input."""
import pytest
import torch

from sparseengine.kernels import row_argmax_ref, row_argmax_triton
from sparseengine.sampling_params import SamplingParams


def _rows(gen, B, V, palette=None):
    if palette is None:
        return torch.randn(B, V, generator=gen)
    return palette[torch.randint(0, len(palette), (B, V), generator=gen)]


@pytest.mark.parametrize("B,V,block", [(1, 10, 16), (6, 1000, 64), (3, 4096, 4096), (5, 4097, 512), (2, 300, 16)])
@pytest.mark.parametrize("kind", ["random", "ties", "specials"])
def test_equals_torch_argmax(gen, device, B, V, block, kind):
    if kind == "random":
        x = _rows(gen, B, V)
    elif kind == "ties":  # a few values: the maximum repeats across chunks
        x = _rows(gen, B, V, torch.tensor([-1.0, 0.5, 2.0, 2.0, 3.0]))
    else:
        x = _rows(gen, B, V, torch.tensor([-float("inf"), -2.0, 1.0, float("inf"), float("inf")]))
        x[0, V // 2:] = float("nan")  # NaNs from the middle on: the first one wins
        x[-1] = -float("inf")  # -inf only: index 0
        if B > 2:
            x[1, -1] = float("nan")  # one NaN, last
    x = x.to(device)
    for _ in range(2):  # the second launch finds the counters at zero again
        got = row_argmax_triton(x, block=block)
        assert got.dtype == torch.int64
        assert torch.equal(got, row_argmax_ref(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_and_strided_rows(gen, device, dtype):
    x = torch.randn(4, 2 * 700, generator=gen).to(dtype).to(device)[:, ::2]  # rows of 700, stride 2
    assert torch.equal(row_argmax_triton(x, block=128), row_argmax_ref(x))


def test_callers_counters(gen, device):
    """A launch with its own counters: the same choice, the counters left at zero for the next."""
    counters = torch.zeros(8, dtype=torch.int32, device=device)
    x = torch.randn(5, 1000, generator=gen).to(device)
    for _ in range(2):
        assert torch.equal(row_argmax_triton(x, block=64, counters=counters), row_argmax_ref(x))
        assert not counters.any()


def test_bad_input(device):
    with pytest.raises(ValueError, match=r"x must be a floating \[B, V\] tensor, got \(3,\)"):
        row_argmax_triton(torch.zeros(3, device=device))
    with pytest.raises(ValueError, match=r"got \(2, 3\) torch.int64"):
        row_argmax_triton(torch.zeros(2, 3, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="at least one column"):
        row_argmax_triton(torch.zeros(2, 0, device=device))
    with pytest.raises(ValueError, match="block must be a power of two >= 16, got 48"):
        row_argmax_triton(torch.zeros(2, 3, device=device), block=48)
    with pytest.raises(ValueError, match="at most 1024 rows"):
        row_argmax_triton(torch.zeros(1025, 3, device=device))
    x = torch.zeros(4, 3, device=device)
    for bad in (torch.zeros(3, dtype=torch.int32, device=device), torch.zeros(8, device=device),
                torch.zeros(2, 8, dtype=torch.int32, device=device), [0] * 8):
        with pytest.raises(ValueError, match="counters must be a contiguous int32 vector of at least 4"):
            row_argmax_triton(x, counters=bad)


@pytest.mark.gpu
def test_gpu_vocab_shape_and_cuda_graph(gen):
    """A decode step's logits (6 x 128256, float32), captured and replayed in a graph."""
    x = torch.randn(6, 128256, generator=gen).cuda()
    assert torch.equal(row_argmax_triton(x), row_argmax_ref(x))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = row_argmax_triton(x)
    for _ in range(3):
        x.copy_(torch.randn(6, 128256, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, row_argmax_ref(x))


@pytest.mark.gpu
def test_gpu_two_samplers_replay_at_once(gen):
    """Two engines' samplers, each greedy launch captured in its own graph and the two
    replayed at once on two streams, many times: each has its own counters, so neither
    reads the other's chunks (with one shared buffer the last-arriving program of a row
    could be the other launch's)."""
    from sparseengine.layers.sampler import Sampler

    samplers = [Sampler(), Sampler()]
    xs = [torch.randn(6, 128256, generator=gen).cuda() for _ in samplers]
    assert samplers[0].argmax_counters(xs[0].device).data_ptr() != samplers[1].argmax_counters(xs[1].device).data_ptr()
    graphs, outs = [], []
    for sampler, x in zip(samplers, xs):
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            outs.append(sampler.sample(x, [SamplingParams(temperature=0.0)] * 6, list(range(6))))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    want = [row_argmax_ref(x) for x in xs]
    for _ in range(200):
        for graph, stream in zip(graphs, streams):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph.replay()
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
    for sampler, x in zip(samplers, xs):
        assert not sampler.argmax_counters(x.device).any()


@pytest.mark.gpu
def test_sampler_greedy_uses_it_on_gpu(gen):
    """The sampler's greedy choice: the kernel on a GPU (bf16 logits' ties, as a dummy
    model's float32 logits hold them), torch beyond its rows a launch."""
    from sparseengine.kernels import row_argmax
    from sparseengine.layers.sampler import greedy

    x = torch.randn(6, 128256, generator=gen).bfloat16().float().cuda()
    x[2, 1000] = x[2, 5] = x[2].max() + 1  # a tie: the first index
    assert torch.equal(greedy(x), torch.argmax(x, -1)) and int(greedy(x)[2]) == 5
    wide = torch.randn(row_argmax.MAX_ROWS + 1, 64, generator=gen).cuda()
    assert torch.equal(greedy(wide), torch.argmax(wide, -1))

