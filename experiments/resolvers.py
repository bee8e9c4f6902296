"""OmegaConf resolvers that read the method registry, so sweeps need no list of methods:

    hydra:
      sweeper:
        params:
          sparse_method: ${methods:decode}    # every registered decode method

On the command line use the shell: python run.py -m sparse_method=$(python -m experiments.resolvers decode)
"""

from __future__ import annotations

from omegaconf import OmegaConf


def _methods(kind: str = "decode") -> str:
    from sparseengine import method_registry as reg

    if kind not in ("decode", "prefill"):
        raise ValueError(f"${{methods:{kind}}}: kind must be 'decode' or 'prefill'")
    names = reg.decode_methods() if kind == "decode" else reg.prefill_methods()
    return ",".join(names)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("methods"):
        OmegaConf.register_new_resolver("methods", _methods)


if __name__ == "__main__":
    import sys

    print(_methods(sys.argv[1] if len(sys.argv) > 1 else "decode"))
