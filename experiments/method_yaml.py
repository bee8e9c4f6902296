"""Write a method's option file from the registry, for the method's author:

    python -m experiments.method_yaml snapkv quest        # conf/sparse_method/{snapkv,quest}.yaml
    python -m experiments.method_yaml --kind prefill h2o_prefill

The YAML holds ``<axis>: <name>`` and the method's hyperparameters at their registry
defaults; ``tests/toolkit/test_method_yaml.py`` checks they stay equal.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

CONF = Path(__file__).resolve().parent.parent / "conf"


def render(name: str, kind: str = "decode") -> str:
    from sparseengine.method_registry import get_spec

    spec = get_spec(name, kind)
    axis = "sparse_method" if kind == "decode" else "prefill_sparse_method"
    doc = f"{name}: {spec.family}" + (f", {spec.paper}" if spec.paper else "")
    body = yaml.safe_dump({axis: name, **spec.knobs}, sort_keys=False)
    return f"# @package engine\n# {doc}\n{body}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write conf/<axis>/<name>.yaml from the method registry")
    ap.add_argument("names", nargs="+")
    ap.add_argument("--kind", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = ap.parse_args(argv)
    axis = "sparse_method" if args.kind == "decode" else "prefill_sparse_method"
    for name in args.names:
        path = CONF / axis / f"{name}.yaml"
        if path.exists() and not args.force:
            print(f"{path} exists (use --force)")
            continue
        path.write_text(render(name, args.kind))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
