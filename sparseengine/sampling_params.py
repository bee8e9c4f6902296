"""Per-request sampling settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparseengine.config import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 means all tokens
    max_tokens: int = 16
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ConfigError(f"Invalid max_tokens={self.max_tokens!r}: must be an integer >= 0")
        if self.temperature < 0:
            raise ConfigError(f"Invalid temperature={self.temperature!r}: must be >= 0 (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"Invalid top_p={self.top_p!r}: must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k == 0 or self.top_k < -1):
            raise ConfigError(f"Invalid top_k={self.top_k!r}: must be -1 (all) or a positive integer")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
