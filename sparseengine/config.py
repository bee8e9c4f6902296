"""Engine configuration: one flat set of names shared by `LLM(...)`, YAML and records.

Core fields are dataclass fields. Method hyperparameters (``snapkv_window``,
``quest_page_size`` ...) are declared by each method's spec in the registry and live in
``Config.method_knobs``; they are read with ``config.knob(name)``. Any other name is an
error that suggests the nearest valid one.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field, fields
from typing import Any


class ConfigError(ValueError):
    """A configuration value or name is invalid. The message names it and the valid ones."""


def resolve_device(device: str):
    """The torch device an engine of ``device`` (a Config value) runs on: ``auto`` is CUDA
    when available, else the CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


_CHOICES: dict[str, tuple[str, ...]] = {
    "load_format": ("auto", "dummy"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "device": ("auto", "cpu", "cuda"),
    "attention_provider": ("auto", "torch", "triton", "flashinfer"),
    "decode_split_plan": ("auto", "per_row"),
    "kv_pool_tiers": ("auto", "off"),
}


@dataclass
class Config:
    model: str = "smollm2-135m-instruct"
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefill_chunk_size: int = 2048
    page_size: int = 16
    kv_cache_memory: float = 1.0  # GiB of KV pool on CPU
    num_kv_pages: int | None = None  # explicit pool size; overrides the memory sizing
    gpu_memory_utilization: float = 0.9
    # A method whose compressed layers keep a few tokens while its other layers keep all
    # of them (DeltaKV) gets a pool in two tiers (engine/pool_plan.py): "auto" where that
    # fits more requests (of kv_pool_tier_tokens) than one tier; "off": every page in every layer
    # (more room for prompts that are never compressed, i.e. shorter than the budget).
    kv_pool_tiers: str = "auto"
    # The request length (prompt + output tokens) the two tiers are sized for: one such
    # request held whole until it is compressed, as many compressed ones beside it as fit.
    # None: max_model_len. Shorter: more narrow pages, so more requests of that length (and
    # more never-compressed short ones); a prompt longer than the narrow tier is refused.
    kv_pool_tier_tokens: int | None = None
    enforce_eager: bool = False
    # Launch each step before reading the previous step's sampled tokens (the host's
    # scheduling overlaps the device's work): None is on for CUDA, off on the CPU (where
    # every op runs synchronously anyway); False reads every step's tokens in that step.
    async_scheduling: bool | None = None
    attention_provider: str = "auto"
    # How the Triton split-K decode cuts rows into programs: "auto" (kernels/split_plan.py;
    # where it cuts rows by their own lengths, balanced across the batch by
    # kernels/balanced_plan.py) or "per_row" (each row by its own length only: the plan
    # before the balanced one, kept for A/B runs).
    decode_split_plan: str = "auto"
    tensor_parallel_size: int = 1
    sparse_method: str = "vanilla"
    prefill_sparse_method: str = "none"
    prefill_policy: str = "auto"
    long_prefill_threshold: int = 65536
    sink_tokens: int = 64
    recent_tokens: int = 512
    budget: int = 4096
    method_knobs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "method_knobs"]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "Config":
        from sparseengine.method_registry import all_knob_defaults

        core = set(cls.field_names())
        knob_defaults = all_knob_defaults()
        core_kw, knobs = {}, {}
        for key, value in kwargs.items():
            if key in core:
                core_kw[key] = value
            elif key in knob_defaults:
                knobs[key] = value
            else:
                valid = sorted(core | set(knob_defaults))
                raise ConfigError(
                    f"Unknown config key {key!r}.{suggest(key, valid)} Valid keys: {', '.join(valid)}"
                )
        cfg = cls(**core_kw, method_knobs=knobs)
        cfg.validate()
        return cfg

    def knob(self, name: str) -> Any:
        from sparseengine.method_registry import all_knob_defaults

        defaults = all_knob_defaults()
        if name not in defaults:
            raise ConfigError(f"No method hyperparameter {name!r}.{suggest(name, list(defaults))}")
        return self.method_knobs.get(name, defaults[name])

    def to_dict(self) -> dict[str, Any]:
        """Flat record of every name with its resolved value (method knobs included)."""
        from sparseengine.method_registry import all_knob_defaults

        out = {k: v for k, v in asdict(self).items() if k != "method_knobs"}
        for name, default in sorted(all_knob_defaults().items()):
            out[name] = self.method_knobs.get(name, default)
        return out

    def validate(self) -> None:
        from sparseengine.method_registry import validate_method_config

        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"Invalid {name}={value!r}. Valid values: {', '.join(choices)}")
        tier = self.kv_pool_tier_tokens
        if tier is not None and (not isinstance(tier, int) or isinstance(tier, bool) or tier <= 0):
            raise ConfigError(f"Invalid kv_pool_tier_tokens={tier!r}: must be a positive integer or None "
                              "(None: size the tiers for max_model_len prompts)")
        if tier is not None and self.kv_pool_tiers == "off":
            raise ConfigError(f"kv_pool_tier_tokens={tier} sizes two tiers, but kv_pool_tiers='off' keeps one: "
                              "set one of them")
        positive = ["max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "page_size",
                    "long_prefill_threshold", "tensor_parallel_size"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"Invalid {name}={value!r}: must be a positive integer")
        if self.page_size & (self.page_size - 1):
            raise ConfigError(f"Invalid page_size={self.page_size!r}: must be a power of two (e.g. 16)")
        for name in ("sink_tokens", "recent_tokens", "budget", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"Invalid {name}={value!r}: must be a non-negative integer")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"Invalid async_scheduling={self.async_scheduling!r}: must be true, false or null (auto)")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= 0):
            raise ConfigError(f"Invalid max_model_len={self.max_model_len!r}: must be a positive integer or None")
        if self.num_kv_pages is not None and (not isinstance(self.num_kv_pages, int) or self.num_kv_pages <= 0):
            raise ConfigError(f"Invalid num_kv_pages={self.num_kv_pages!r}: must be a positive integer or None")
        if not (isinstance(self.kv_cache_memory, (int, float)) and self.kv_cache_memory > 0):
            raise ConfigError(f"Invalid kv_cache_memory={self.kv_cache_memory!r}: GiB, must be > 0")
        if not (0.0 < float(self.gpu_memory_utilization) <= 1.0):
            raise ConfigError(f"Invalid gpu_memory_utilization={self.gpu_memory_utilization!r}: must be in (0, 1]")
        if self.tensor_parallel_size != 1:
            raise ConfigError(f"Invalid tensor_parallel_size={self.tensor_parallel_size!r}: only 1 is supported so far")
        validate_method_config(self)

    @property
    def total_attended(self) -> int:
        return self.sink_tokens + self.budget + self.recent_tokens
