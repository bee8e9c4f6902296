"""Natural text for perplexity and fidelity, available offline.

``text_path`` (a UTF-8 file) when given; otherwise the module docstrings of Python's
standard library, in sorted file order (deterministic for a Python version, no download).
Models without a tokenizer get seeded random token ids instead.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

STDLIB_CORPUS = "python-stdlib-docstrings"


def stdlib_docstrings(min_chars: int) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8", errors="ignore")))
        except (SyntaxError, ValueError):
            continue
        if doc and len(doc) > 200:
            parts.append(doc)
            total += len(doc)
            if total >= min_chars:
                break
    return "\n\n".join(parts)


def token_windows(tokenizer, vocab_size: int, length: int, count: int, seed: int,
                  text_path: str | None = None) -> list[list[int]]:
    """``count`` non-overlapping windows of ``length`` tokens from the corpus."""
    if tokenizer is None:
        rng = random.Random(f"corpus-{seed}")
        return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]
    need = length * count
    text = Path(text_path).read_text(encoding="utf-8") if text_path else stdlib_docstrings(need * 6)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < need:
        raise ValueError(f"the corpus ({text_path or STDLIB_CORPUS}) has {len(ids)} tokens, fewer than "
                         f"num_samples x context_length = {count} x {length}; lower them or give task.text_path")
    return [ids[i * length:(i + 1) * length] for i in range(count)]
