"""On a GPU, a method whose hooks the decode CUDA graph captures must produce the tokens its
eager run produces: same kernels, same shapes (the batch is a bucket size, so no padding
row changes a GEMM's shape), so the greedy tokens agree exactly."""

from __future__ import annotations

import pytest
import torch

CAPTURED = ["vanilla", "snapkv", "pyramidkv", "quest", "omnikv"]


@pytest.mark.gpu
@pytest.mark.parametrize("method", CAPTURED)
def test_graph_replay_tokens_equal_eager(method, tiny_llama, tiny_method_knobs):
    from sparseengine import LLM, SamplingParams

    folder, _ = tiny_llama
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (160,), generator=gen).tolist() for _ in range(4)]  # one prefill step
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    knobs = {k: v for k, v in tiny_method_knobs.items() if k.startswith(method)}
    tokens, graph_steps = {}, {}
    for eager in (True, False):
        with LLM(str(folder), device="cuda", dtype="float32", sparse_method=method, sink_tokens=4, budget=24,
                 recent_tokens=8, num_kv_pages=256, max_num_batched_tokens=1024, enforce_eager=eager,
                 **knobs) as llm:
            tokens[eager] = [o.token_ids for o in llm.generate(prompts, params)]
            graph_steps[eager] = llm.runner.graph_steps
    assert graph_steps[True] == 0 and graph_steps[False] >= 30, graph_steps  # the graph really replayed
    assert tokens[False] == tokens[True]
