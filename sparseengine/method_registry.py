"""The method registry: the single source of truth for what each sparse method is.

Each method's runtime file under ``sparseengine/methods/`` declares ``SPEC = MethodSpec(...)``.
The registry discovers them, so adding a method touches its runtime file and its YAML file
only. Configs, the scheduler, benchmarks and tests read the registry; none restates it.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from sparseengine.config import ConfigError, suggest

if TYPE_CHECKING:
    from sparseengine.config import Config

PREFILL_POLICIES = ("all_chunked", "long_bs1full_short_batch")


@dataclass(frozen=True)
class MethodSpec:
    """What a method is and needs. ``kind`` is "decode" (the ``sparse_method`` axis) or
    "prefill" (the ``prefill_sparse_method`` axis)."""

    name: str
    kind: str
    family: str
    runtime: type
    prefill_policy: str = "all_chunked"  # registry default for decode methods
    combines_with: tuple[str, ...] = ()  # prefill methods: the decode methods they pair with
    needs_scores: bool = False
    frees_memory: bool = False
    knobs: dict[str, Any] = field(default_factory=dict)
    paper: str = ""
    # The Config field that a total-budget sweep sets: "budget" (total = sink + budget +
    # recent) or "recent_tokens" (total = sink + recent; the method leaves budget unused).
    budget_knob: str = "budget"


@lru_cache(maxsize=1)
def _specs() -> dict[str, MethodSpec]:
    import sparseengine.methods as pkg

    specs: dict[str, MethodSpec] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        spec = getattr(module, "SPEC", None)
        if isinstance(spec, MethodSpec):
            if spec.name in specs:
                raise RuntimeError(f"Two methods are registered as {spec.name!r}")
            specs[spec.name] = spec
    return specs


def decode_methods() -> list[str]:
    return sorted(n for n, s in _specs().items() if s.kind == "decode")


def prefill_methods() -> list[str]:
    return sorted(n for n, s in _specs().items() if s.kind == "prefill")


def get_spec(name: str, kind: str = "decode") -> MethodSpec:
    names = decode_methods() if kind == "decode" else prefill_methods()
    if name not in names:
        key = "sparse_method" if kind == "decode" else "prefill_sparse_method"
        raise ConfigError(f"Unknown {key}={name!r}.{suggest(name, names)} Valid values: {', '.join(names)}")
    return _specs()[name]


def split_total(method: str, total: int, sink: int, recent: int, what: str | None = None) -> dict[str, int]:
    """The engine knobs that give ``method`` ``total`` attended tokens with ``sink`` sink
    tokens: ``budget`` = total - sink - recent, or, for a method that leaves ``budget``
    unused (its registry ``budget_knob`` is ``recent_tokens``: StreamingLLM),
    ``recent_tokens`` = total - sink and ``budget`` 0."""
    what = what or f"total={total} is"
    if get_spec(method).budget_knob == "recent_tokens":
        if total < sink:
            raise ValueError(f"{what} fewer than sink_tokens ({sink}); lower it")
        return {"recent_tokens": total - sink, "budget": 0}
    if total - sink - recent < 0:
        raise ValueError(f"{what} fewer than sink_tokens + recent_tokens ({sink} + {recent}); lower them")
    return {"budget": total - sink - recent}


def all_knob_defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in _specs().values():
        for key, value in spec.knobs.items():
            if key in out and out[key] != value:
                raise RuntimeError(f"Hyperparameter {key!r} has two defaults in the registry")
            out[key] = value
    return out


def resolve_prefill_policy(config: "Config") -> str:
    return get_spec(config.sparse_method).prefill_policy if config.prefill_policy == "auto" else config.prefill_policy


def validate_method_config(config: "Config") -> None:
    """Raise ConfigError for an unknown method, policy or an incompatible combination."""
    spec = get_spec(config.sparse_method, "decode")
    pre = get_spec(config.prefill_sparse_method, "prefill")
    if config.prefill_policy != "auto":
        if config.prefill_policy not in PREFILL_POLICIES:
            raise ConfigError(
                f"Invalid prefill_policy={config.prefill_policy!r}."
                f"{suggest(config.prefill_policy, list(PREFILL_POLICIES))}"
                f" Valid values: auto, {', '.join(PREFILL_POLICIES)}"
            )
        if config.prefill_policy != spec.prefill_policy:
            raise ConfigError(
                f"prefill_policy={config.prefill_policy!r} disagrees with the registry default "
                f"{spec.prefill_policy!r} of sparse_method={spec.name!r}; use prefill_policy=auto"
            )
    if pre.combines_with != ("*",) and spec.name not in pre.combines_with:
        raise ConfigError(
            f"prefill_sparse_method={pre.name!r} does not combine with sparse_method={spec.name!r}; "
            f"it combines with: {', '.join(pre.combines_with)}"
        )
    for spec_ in (spec, pre):
        for key in spec_.knobs:
            if key in config.method_knobs:
                _check_knob_type(key, config.method_knobs[key], spec_.knobs[key])


def _check_knob_type(key: str, value: Any, default: Any) -> None:
    if default is None or value is None:
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"Invalid {key}={value!r}: expected a {type(default).__name__} like the default {default!r}")
