"""Fixtures of the FlashInfer provider's GPU tests (test_flashinfer_provider, test_flashinfer_graphs)."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture
def flashinfer():
    return pytest.importorskip("flashinfer")


@pytest.fixture(scope="module")
def tiny_llama_d128(tmp_path_factory):
    """The tiny Llama with FlashInfer's head_dim 128 (the one head_dim the GPU tests build
    kernels for) and a GQA group of 4 (tensor-core decode)."""
    import transformers

    from sparseengine.models.loader import SHAPES_DIR

    cfg = json.loads((SHAPES_DIR / "tiny-llama.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, head_dim=128)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0, 0.1)
    folder = tmp_path_factory.mktemp("tiny-llama-d128")
    hf.save_pretrained(folder)
    return folder
