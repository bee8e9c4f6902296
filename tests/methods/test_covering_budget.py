"""With a budget covering prompt and output (nothing evicted, skipped or compressed),
every method generates vanilla's tokens, on the random tiny models of
``test_engine_selection.py`` (GQA 4/2, Qwen3 6/2, 8/2)."""

from __future__ import annotations

import pytest

from sparseengine import LLM, SamplingParams
from tests.methods.test_engine_selection import model, prompt  # noqa: F401 (model: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/methods/conftest.py

NEW = 10
PROMPT_LENS = (37, 52)
COVER = max(PROMPT_LENS) + NEW - 1  # the most tokens a cache ever holds


def covering(method: str) -> dict:
    """Knobs whose total is exactly COVER: nothing may be evicted or skipped."""
    base = dict(sink_tokens=4, recent_tokens=8, budget=COVER - 12)
    return {
        "vanilla": {},
        "streamingllm": dict(sparse_method="streamingllm", sink_tokens=4, recent_tokens=COVER - 4, budget=0),
        "streamingllm_rerotate": dict(sparse_method="streamingllm", sink_tokens=4, recent_tokens=COVER - 4,
                                      budget=0, streamingllm_rerotate=True),
        "snapkv": dict(base, sparse_method="snapkv", snapkv_window=8),
        "pyramidkv": dict(base, sparse_method="pyramidkv", snapkv_window=8),
        "h2o": dict(base, sparse_method="h2o"),
        "omnikv": dict(base, sparse_method="omnikv", omnikv_filter_layers="1"),
        "quest": dict(base, sparse_method="quest", quest_page_size=8, quest_skip_layers=0),
    }[method]


@pytest.mark.parametrize("name", ["g2", "g3", "g4"])
def test_covering_budget_generates_vanilla_tokens(model, name):
    folder, hf = model(name)
    ids = [prompt(n, seed=7 * n) for n in PROMPT_LENS]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outputs = {}
    for method in ("vanilla", "streamingllm", "streamingllm_rerotate", "snapkv", "pyramidkv", "h2o",
                   "omnikv", "quest"):
        with LLM(str(folder), dtype="float32", device="cpu", page_size=8, kv_cache_memory=0.01,
                 **covering(method)) as llm:
            outputs[method] = [o.token_ids for o in llm.generate(ids, params)]
    for method, tokens in outputs.items():
        assert tokens == outputs["vanilla"], f"{method} differs from vanilla with a covering budget"
