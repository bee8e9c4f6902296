"""Shared fixtures: the embedded SmolLM2 (engine + Hugging Face twin), tiny random models, and the
repository's scripts loaded as modules."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
if not torch.cuda.is_available():  # Triton kernels run interpreted; must precede any triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
# CI runs the suite on both cores with pytest-xdist: one torch thread per worker, so workers do not oversubscribe
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def load_script():
    """`load_script(NAME)`: scripts/NAME.py as a module (the scripts are not a package)."""
    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def smollm2_folder():
    from sparseengine.models import loader

    return loader.resolve(loader.EMBEDDED_MODEL, "auto").folder


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_folder), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2():
    from sparseengine import LLM

    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    yield llm
    llm.close()


def make_tiny_hf_folder(tmp_path_factory, shape: str, seed: int = 0):
    """An HF model built from a shipped tiny config with random weights, saved as safetensors."""
    import transformers
    from sparseengine.models.loader import SHAPES_DIR

    cfg = json.loads((SHAPES_DIR / f"{shape}.json").read_text())
    config_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[cfg["model_type"]]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[cfg["model_type"]]
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**cfg)).eval()
    with torch.no_grad():  # larger than default init so attention is not uniform
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.1)
            else:
                p.uniform_(0.8, 1.2)
    folder = tmp_path_factory.mktemp(shape)
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_hf_folder(tmp_path_factory, "tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_hf_folder(tmp_path_factory, "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_method_knobs(tiny_llama, tmp_path_factory):
    """Method hyperparameters the tiny Llama needs (it has no per-model table entries):
    OmniKV / DeltaKV full layers, a DeltaKV checkpoint calibrated on it, a FlashPrefill
    threshold."""
    from sparseengine.methods.deltakv_calibrate import calibrate

    folder, hf = tiny_llama
    ckpt = tmp_path_factory.mktemp("deltakv") / "tiny.safetensors"
    ids = torch.randint(3, hf.config.vocab_size, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    calibrate(str(folder), token_ids=ids, out=ckpt, latent_dim=32, sink_tokens=2, segment_tokens=300,
              progress=False, dtype="float32", page_size=8)
    return {"omnikv_filter_layers": "1", "deltakv_full_layers": "1", "deltakv_checkpoint_path": str(ckpt),
            "deltakv_latent_dim": 32, "flashprefill_threshold": 0.01}
