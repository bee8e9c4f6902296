"""On a GPU, a method whose hooks the decode CUDA graph captures must produce the tokens its
eager run produces: same kernels, same shapes (the batch is a bucket size, so no padding
row changes a GEMM's shape), so the greedy tokens agree exactly."""

from __future__ import annotations

import pytest
import torch

CAPTURED = ["vanilla", "snapkv", "pyramidkv", "quest", "omnikv", "streamingllm", "h2o", "deltakv"]


def eager_and_graph(folder, method, knobs, prompts, params):
    """{eager: (token ids per request, graph steps, the decode graphs' captures)} for eager=True and False."""
    from sparseengine import LLM

    knobs = {k: v for k, v in knobs.items() if k.startswith(method)}
    out = {}
    for eager in (True, False):
        with LLM(str(folder), device="cuda", dtype="float32", sparse_method=method, sink_tokens=4, budget=24,
                 recent_tokens=8, num_kv_pages=256, max_num_batched_tokens=1024, enforce_eager=eager,
                 **knobs) as llm:
            tokens = [o.token_ids for o in llm.generate(prompts, params)]
            graphs = llm.runner.graphs
            out[eager] = (tokens, llm.runner.graph_steps, [] if graphs is None else graphs.captured)
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
@pytest.mark.parametrize("method", ["vanilla", "streamingllm", "quest", "h2o", "deltakv"])
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


@pytest.mark.gpu
def test_deltakv_graph_replays_across_history_flushes(tiny_llama, tiny_method_knobs):
    """DeltaKV's graphs are keyed by its requests' state: one capture for the batch, then
    replays while the flushes (every 64 decode steps) append to the codec buffers and move
    the history's end on the device. Tokens equal the eager run's."""
    from sparseengine import SamplingParams

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (160, 140)]
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)  # two flushes each
    out = eager_and_graph(tiny_llama[0], "deltakv", tiny_method_knobs, prompts, params)
    assert out[True][1] == 0 and out[False][1] >= 140, out
    # flushes within the buffers' capacity keep the graph
    assert [size for size, _ in out[False][2]] == [2], out[False][2]
    assert out[False][0] == out[True][0]


@pytest.mark.gpu
def test_h2o_scores_summed_in_the_graph_equal_eager(tiny_llama):
    """H2O adds the column sums into its score pool inside the graph. After the same run,
    the score and position pools hold what the eager run's hold (a capture's warm-up runs
    must not add the step it captures twice), and the tokens agree."""
    from sparseengine import LLM, SamplingParams
    from sparseengine.methods.h2o import POSITIONS, SCORES

    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (150, 90, 40, 120)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = {}
    for eager in (True, False):
        with LLM(str(tiny_llama[0]), device="cuda", dtype="float32", sparse_method="h2o", sink_tokens=4,
                 budget=24, recent_tokens=8, num_kv_pages=256, enforce_eager=eager) as llm:
            tokens = [o.token_ids for o in llm.generate(prompts, params)]
            pools = (llm.cache.token_pool(SCORES, torch.float32).clone(),
                     llm.cache.token_pool(POSITIONS, torch.int32).clone())
            out[eager] = (tokens, pools, llm.runner.graph_steps)
    assert out[True][2] == 0 and out[False][2] >= 20
    assert out[False][0] == out[True][0]
    torch.testing.assert_close(out[False][1][0], out[True][1][0], rtol=1e-6, atol=1e-7)
    assert torch.equal(out[False][1][1], out[True][1][1])


@pytest.mark.gpu
def test_quest_cuda_choice_gives_the_triton_choices_tokens(tiny_llama, tiny_method_knobs, monkeypatch):
    """Quest's decode step selects with the CUDA kernel where it runs (`quest_select_cuda`):
    eager and replayed tokens equal those of the Triton selection's run."""
    from sparseengine import SamplingParams
    from sparseengine.kernels import quest_select_cuda

    assert quest_select_cuda.takes("cuda", 64)  # the H200 runs it: its absence there is a failure
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (160, 75, 131, 98)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    cuda = eager_and_graph(tiny_llama[0], "quest", tiny_method_knobs, prompts, params)
    monkeypatch.setattr(quest_select_cuda, "ENGINE", False)
    triton = eager_and_graph(tiny_llama[0], "quest", tiny_method_knobs, prompts, params)
    assert cuda[False][1] >= 30 and triton[False][1] >= 30
    assert cuda[True][0] == triton[True][0] and cuda[False][0] == triton[False][0]


@pytest.mark.gpu
@pytest.mark.parametrize("method,score", [("omnikv", "logits"), ("omnikv", "probs"), ("deltakv", None)])
def test_omnikv_cuda_pick_gives_the_triton_picks_tokens(method, score, tiny_llama, tiny_method_knobs, monkeypatch):
    """OmniKV's filter layers (either score mode; and DeltaKV's full layers) pick with the CUDA
    kernel where it runs (`omnikv_select_cuda`): eager and replayed tokens equal those of the
    Triton pick's run, on prompts past the total (a real choice) and within it."""
    from sparseengine import SamplingParams
    from sparseengine.kernels import omnikv_select_cuda

    assert omnikv_select_cuda.runs_on("cuda")  # the H200 runs it: its absence there is a failure
    knobs = {**tiny_method_knobs, **({"omnikv_score": score} if score else {})}
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (160, 75, 131, 20)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    picks, real = [], omnikv_select_cuda.omnikv_select_cuda
    monkeypatch.setattr(omnikv_select_cuda, "omnikv_select_cuda", lambda *a, **k: picks.append(1) or real(*a, **k))
    cuda = eager_and_graph(tiny_llama[0], method, knobs, prompts, params)
    assert picks  # the CUDA kernel made the picks
    monkeypatch.setattr(omnikv_select_cuda, "ENGINE", False)
    triton = eager_and_graph(tiny_llama[0], method, knobs, prompts, params)
    assert cuda[False][1] >= 30 and triton[False][1] >= 30
    assert cuda[True][0] == triton[True][0] and cuda[False][0] == triton[False][0]
