"""Model names as the per-model tables know them.

Per-model tables (OmniKV filter layers, FlashPrefill thresholds, ...) are keyed by the
shipped names (``llama-3.1-8b``, ``smollm2-135m-instruct``). A model loaded from a folder
or a GGUF file is named after it (``SmolLM2-135M-Instruct``, ``SmolLM2-135M-Instruct.Q4_1``):
``canonical`` lowercases such a name and drops a weight-format suffix, so it finds the
same entry. An exact key always wins.
"""

from __future__ import annotations

import re
from typing import TypeVar

T = TypeVar("T")

# ".Q4_1", "-q4_k_m", ".f16", "-bf16", ".IQ3_XS", "-gguf": what GGUF and quantised folder names append
_SUFFIX = re.compile(r"([.\-_](i?q\d[a-z0-9_]*|f16|f32|bf16|fp16|fp32|gguf))+$", re.IGNORECASE)


def canonical(name: str) -> str:
    return _SUFFIX.sub("", name.strip()).lower()


def table_entry(table: dict[str, T], name: str) -> T | None:
    """``table[name]``, else the entry of the canonical name, else None."""
    if name in table:
        return table[name]
    return table.get(canonical(name))
