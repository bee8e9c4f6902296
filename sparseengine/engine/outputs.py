"""What ``LLM.generate`` returns: one output per prompt, in order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length" or "error"
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
