"""`bench_gpu`'s parts: every `--flag` names benchmark functions that exist (the benchmarks
themselves need a GPU, so a renamed function would otherwise fail only on the device)."""

from __future__ import annotations

import importlib

import pytest

from sparseengine.kernels import bench_gpu


@pytest.mark.parametrize("flag", sorted(bench_gpu.PARTS))
def test_each_part_names_functions_that_exist(flag):
    _, module, functions = bench_gpu.PARTS[flag]
    bench = importlib.import_module(f"sparseengine.kernels.{module}")
    missing = [name for name in functions if not callable(getattr(bench, name, None))]
    assert functions and not missing, f"--{flag}: {module} has no {missing}"
