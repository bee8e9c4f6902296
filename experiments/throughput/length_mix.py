"""A ragged batch's prompt lengths: ``task.length_mix``, pairs ``[prompt tokens, count]``.

The pairs spell out one pattern (``[[131072, 1], [4096, 15]]``: one 128K prompt, then 15
of 4K); request i of a batch takes the pattern's entry ``i % len(pattern)``, so a batch of
32 holds two 128K prompts and 30 short ones, and the batch-size search grows the batch
by whole requests of the same pattern. ``None`` (the default) is every request at
``task.context_length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LengthMix:
    pattern: tuple[int, ...]  # one prompt length per request, repeated over a batch

    @classmethod
    def parse(cls, value: Any, context_length: int) -> "LengthMix":
        """``task.length_mix`` (or None: every request ``context_length`` tokens)."""
        if value is None:
            return cls((int(context_length),))
        pairs = list(value) if isinstance(value, (list, tuple)) else None
        ok = bool(pairs) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs)
        ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for p in pairs for x in p)
        if not ok:
            raise ValueError(f"Invalid task.length_mix={value!r}: a list of [prompt tokens, count] pairs of "
                             "positive integers, e.g. [[131072, 1], [4096, 15]]")
        return cls(tuple(n for n, count in pairs for _ in range(count)))

    @property
    def ragged(self) -> bool:
        return len(set(self.pattern)) > 1

    def lengths(self, batch: int) -> list[int]:
        return [self.pattern[i % len(self.pattern)] for i in range(batch)]

    def label(self) -> str:
        """``131072x1+4096x15``: the pattern's runs of equal lengths."""
        runs: list[list[int]] = []
        for n in self.pattern:
            if runs and runs[-1][0] == n:
                runs[-1][1] += 1
            else:
                runs.append([n, 1])
        return "+".join(f"{n}x{c}" for n, c in runs)
