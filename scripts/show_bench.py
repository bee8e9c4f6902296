"""Print a benchmark's JSON lines from stdin as rows: records of one kind, the named
fields in columns; other lines (tracebacks, progress) pass through, cut to 300 characters.
Usage: python -m sparseengine.kernels.bench_gpu ... | python scripts/show_bench.py KIND FIELD..."""
from __future__ import annotations

import json
import sys


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 else f"{value:.1f}"
    return str(value)[:200]


def main(argv: list[str]) -> None:
    kind, fields = argv[0], argv[1:]
    for line in sys.stdin:
        try:
            record = json.loads(line)
        except ValueError:
            print(line.rstrip()[-300:])
            continue
        if isinstance(record, dict) and record.get("kind") == kind:
            shown = fields + (["error"] if "error" in record else [])
            print("  ".join(f"{cell(record.get(f, '')):>16}" for f in shown))


if __name__ == "__main__":
    main(sys.argv[1:])
