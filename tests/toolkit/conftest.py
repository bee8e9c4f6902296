"""Shared helpers for the toolkit tests: the repo root, composing configs, running run.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
GROUPS = ["model", "sparse_method", "prefill_sparse_method", "prefill_policy", "batch", "context", "task", "logger",
          "debug"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose(overrides: list[str], return_hydra_config: bool = False):
    from hydra import compose as hydra_compose, initialize_config_dir

    from experiments.resolvers import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=return_hydra_config)


def run_py(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from sparseengine.models import loader

    try:
        return loader.load_tokenizer(loader.resolve("smollm2-135m-instruct", "auto"))
    except Exception as exc:  # the embedded model's package is missing
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")
