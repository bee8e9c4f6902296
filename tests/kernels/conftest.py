"""Kernel tests: Triton runs under its interpreter on CPU-only machines.

TRITON_INTERPRET must be set before Triton is imported. The kernel package imports Triton
only at the first kernel launch, and this conftest sets the variable before any test here
runs (setdefault: an explicit value wins). If something else in the same pytest process
imports triton before this conftest loads (an earlier-collected test module), set
TRITON_INTERPRET=1 in a root conftest instead. On a CUDA machine the tests run compiled.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import zlib  # noqa: E402

import pytest  # noqa: E402

from sparseengine.kernels import _common  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


@pytest.fixture(autouse=True)
def _skip_gpu_without_cuda(request):
    if request.node.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _poison_kernel_buffers(monkeypatch):
    """Every buffer a Triton wrapper allocates starts as NaN, so unwritten entries show."""

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(_common, "empty", nan_empty)


@pytest.fixture
def gen(request):
    """A generator seeded from the test id: fresh inputs per test, stable across runs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def device():
    return DEVICE
