"""flashprefill_v2 on the Triton provider (interpreted on a CPU): the engine gives the torch
reference provider's tokens, with block masks that really skip blocks: prompts batched in
one pass; chunks that start mid-block with column sums under the masks (SnapKV); chunks
beside decode rows that read a selection (Quest: the 50-token prompt decodes while the
120-token one is still prefilling)."""

from __future__ import annotations

import pytest
import torch

from sparseengine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/methods/conftest.py

ENGINE = dict(dtype="float32", page_size=8, kv_cache_memory=0.01)  # CPU here; compiled on a GPU
FLASHPREFILL = dict(prefill_sparse_method="flashprefill_v2", flashprefill_block=16, flashprefill_min_len=0,
                    flashprefill_sink_blocks=1, flashprefill_window_blocks=1, flashprefill_probe_blocks=2,
                    flashprefill_threshold=0.15)  # keeps some estimated blocks, skips others
SMALL_TOTAL = dict(sink_tokens=2, budget=16, recent_tokens=8)
CASES = [
    ("vanilla", dict(prefill_chunk_size=512)),
    ("snapkv", dict(prefill_chunk_size=40, snapkv_window=4, **SMALL_TOTAL)),
    ("quest", dict(prefill_chunk_size=40, quest_page_size=8, quest_skip_layers=1, **SMALL_TOTAL)),
]


@pytest.mark.parametrize("decode,kw", CASES, ids=[f"{d}-chunk{kw['prefill_chunk_size']}" for d, kw in CASES])
def test_triton_provider_matches_torch_provider(tiny_llama, decode, kw):
    folder, hf = tiny_llama
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (120, 50)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = {}
    for provider in ("torch", "triton"):
        with LLM(str(folder), **ENGINE, attention_provider=provider, sparse_method=decode, **FLASHPREFILL,
                 **kw) as llm:
            assert llm.provider.name == provider
            outs[provider] = [o.token_ids for o in llm.generate(prompts, params)]
            stats = llm.method.parts[0].summary()
            assert stats["sparse"] and stats["block_fraction"] < 0.9, stats
    assert outs["triton"] == outs["torch"]
