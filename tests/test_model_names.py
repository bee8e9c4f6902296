"""A model loaded from its folder or GGUF file finds the per-model table entries of its
shipped name (OmniKV filter layers, FlashPrefill thresholds, DeltaKV checkpoints)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparseengine import ConfigError
from sparseengine.methods.omnikv import FILTER_LAYERS, filter_layers_for
from sparseengine.models.names import canonical, table_entry


@pytest.mark.parametrize("name, want", [
    ("smollm2-135m-instruct", "smollm2-135m-instruct"),
    ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
    ("SmolLM2-135M-Instruct.Q4_1", "smollm2-135m-instruct"),
    ("Llama-3.1-8B-Q4_K_M", "llama-3.1-8b"),
    ("llama-3.1-8b.f16", "llama-3.1-8b"),
    ("Qwen3-8B-GGUF", "qwen3-8b"),
    ("Qwen3-8B-IQ3_XS.gguf", "qwen3-8b"),  # a name that kept its extension
    ("tiny-llama", "tiny-llama"),
])
def test_canonical_drops_case_and_weight_format(name, want) -> None:
    assert canonical(name) == want


def test_table_entry_prefers_the_exact_key() -> None:
    table = {"Odd-Name.Q4_1": 1, "odd-name": 2}
    assert table_entry(table, "Odd-Name.Q4_1") == 1
    assert table_entry(table, "ODD-NAME.q8_0") == 2
    assert table_entry(table, "other") is None


def test_omnikv_filter_layers_found_for_the_embedded_gguf_name() -> None:
    model = SimpleNamespace(name="SmolLM2-135M-Instruct.Q4_1", num_layers=30)
    assert filter_layers_for(model, "", "omnikv_filter_layers", FILTER_LAYERS) == [2, 4, 21]
    with pytest.raises(ConfigError, match="has no default omnikv_filter_layers"):
        filter_layers_for(SimpleNamespace(name="mystery-7b", num_layers=30), "", "omnikv_filter_layers",
                          FILTER_LAYERS)
