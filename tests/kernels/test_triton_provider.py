"""The engine on the Triton provider gives the torch reference provider's tokens
(interpreted on CPU at tiny shapes; compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from sparseengine import LLM, SamplingParams

METHODS = [
    ("vanilla", {}),
    ("quest", dict(quest_page_size=8, quest_skip_layers=1)),
    ("h2o", {}),
    ("snapkv", dict(snapkv_window=4)),
    ("omnikv", dict(omnikv_filter_layers="1")),
]


@pytest.mark.parametrize("method,knobs", METHODS, ids=[m for m, _ in METHODS])
def test_triton_provider_matches_torch_provider(tiny_llama, method, knobs):
    folder, hf = tiny_llama
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (23, 17)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    kw = dict(dtype="float32", page_size=8, kv_cache_memory=0.01, sparse_method=method,
              sink_tokens=2, budget=8, recent_tokens=4, **knobs)
    outs = {}
    for provider in ("torch", "triton"):
        with LLM(str(folder), attention_provider=provider, **kw) as llm:
            assert llm.provider.name == provider
            outs[provider] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]
