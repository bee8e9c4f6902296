"""The architecture facts the engine needs, read from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparseengine.config import ConfigError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token across all layers, per element byte (multiply by dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        per_layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        kind = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if kind is None and model_type in SUPPORTED_ARCHITECTURES.values():
            kind = model_type
        if kind is None:
            raise ConfigError(
                f"Unsupported architecture {archs or model_type!r} in {name or 'config'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if kind == "mistral" and cfg.get("sliding_window"):
            raise ConfigError(f"{name}: Mistral with sliding_window={cfg['sliding_window']} is not supported "
                              "(only full-attention checkpoints, sliding_window null)")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", "default")
        if scaling is None and rope_type not in ("default", None):
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] not in ("default", "llama3", "linear"):
                raise ConfigError(f"{name}: rope type {scaling['rope_type']!r} is not supported "
                                  "(default, linear, llama3)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        num_heads = cfg["num_attention_heads"]
        return cls(
            name=name,
            model_type=kind,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", kind == "qwen2")),
            qk_norm=kind == "qwen3",
            eos_token_ids=eos_ids,
        )
