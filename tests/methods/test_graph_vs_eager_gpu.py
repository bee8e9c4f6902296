"""On a GPU, a method whose hooks the decode CUDA graph captures must produce the tokens its
eager run produces: same kernels, same shapes (the batch is a bucket size, so no padding
row changes a GEMM's shape), so the greedy tokens agree exactly."""

from __future__ import annotations

import pytest
import torch

CAPTURED = ["vanilla", "snapkv", "pyramidkv", "quest", "omnikv", "streamingllm"]


def eager_and_graph(folder, method, knobs, prompts, params):
    """{eager: (token ids per request, graph steps)} for eager=True and False."""
    from sparseengine import LLM

    knobs = {k: v for k, v in knobs.items() if k.startswith(method)}
    out = {}
    for eager in (True, False):
        with LLM(str(folder), device="cuda", dtype="float32", sparse_method=method, sink_tokens=4, budget=24,
                 recent_tokens=8, num_kv_pages=256, max_num_batched_tokens=1024, enforce_eager=eager,
                 **knobs) as llm:
            out[eager] = ([o.token_ids for o in llm.generate(prompts, params)], llm.runner.graph_steps)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("method", CAPTURED)
def test_graph_replay_tokens_equal_eager(method, tiny_llama, tiny_method_knobs):
    from sparseengine import SamplingParams

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (160,), generator=gen).tolist() for _ in range(4)]  # one prefill step
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = eager_and_graph(tiny_llama[0], method, tiny_method_knobs, prompts, params)
    assert out[True][1] == 0 and out[False][1] >= 30, out  # the graph really replayed
    assert out[False][0] == out[True][0]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["vanilla", "streamingllm", "quest"])
def test_graph_rows_follow_requests_that_finish(method, tiny_llama, tiny_method_knobs):
    """Requests of different lengths; two finish early, so the graph's rows then hold other
    requests (batch 4, then 2: bucket sizes, no padding). The page-table rows a replay reads
    must follow them: tokens equal the eager run's."""
    from sparseengine import SamplingParams

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (160, 75, 131, 98)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 45, 12, 45)]
    out = eager_and_graph(tiny_llama[0], method, tiny_method_knobs, prompts, params)
    assert out[True][1] == 0 and out[False][1] >= 40, out
    assert out[False][0] == out[True][0]
