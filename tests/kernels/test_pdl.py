"""Programmatic dependent launch (PDL): on an sm_90+ GPU every Triton kernel is launched so
that its blocks may start while the previous kernel drains. That is safe only if the
kernel's first statement waits for the previous kernel (`wait_prior`); a kernel without it
would read what the previous kernel has not finished writing."""
import ast
import importlib
import inspect
import pkgutil

import pytest
import torch

import sparseengine.kernels as kernels_pkg
from sparseengine.kernels import _common
from sparseengine.kernels.testing import randn


def lazy_kernels():
    found = {}
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        module = importlib.import_module(f"sparseengine.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, _common.LazyKernel) and value.fn.__module__ == module.__name__:
                found[f"{info.name}.{name}"] = value
    return found


KERNELS = lazy_kernels()


def test_the_package_has_its_kernels():
    assert len(KERNELS) >= 20, sorted(KERNELS)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_kernel_waits_for_the_previous_one_first(name):
    fn = ast.parse(inspect.getsource(KERNELS[name].fn).lstrip()).body[0]
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    first = body[0]
    assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
            and getattr(first.value.func, "id", None) == "wait_prior"), (
        f"{name}'s first statement must be wait_prior(): it is launched with PDL on sm_90+")


def test_pdl_is_off_by_default_under_the_interpreter_and_refuses_unknown_modes(monkeypatch):
    monkeypatch.setattr(_common, "_pdl", None)
    monkeypatch.delenv("SPARSEENGINE_PDL", raising=False)
    assert _common.pdl_enabled() is False
    monkeypatch.setattr(_common, "_pdl", None)
    monkeypatch.setenv("SPARSEENGINE_PDL", "wait")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _common.pdl_enabled() is False
    monkeypatch.setattr(_common, "_pdl", None)
    monkeypatch.setenv("SPARSEENGINE_PDL", "1")
    with pytest.raises(ValueError, match="SPARSEENGINE_PDL='1'; valid: 0, wait, early"):
        _common.pdl_enabled()


@pytest.mark.gpu
def test_a_graph_of_dependent_pdl_launches_equals_the_torch_chain(monkeypatch):
    """200 RMSNorms with the residual add, each reading the previous one's outputs, in one
    CUDA graph, launched with PDL (sm_90+): bit for bit the torch chain."""
    from sparseengine.kernels.fused_ops import add_rms_norm_ref, add_rms_norm_triton

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90")
    monkeypatch.setattr(_common, "_pdl", True)

    gen = torch.Generator().manual_seed(0)
    x0 = randn(6, 4096, generator=gen, dtype=torch.bfloat16, device="cuda")
    r0 = randn(6, 4096, generator=gen, dtype=torch.bfloat16, device="cuda")
    w = (1 + 0.1 * randn(4096, generator=gen, device="cuda")).to(torch.bfloat16)

    def chain(norm, x, r):
        for _ in range(200):
            x, r = norm(x, r, w, 1e-5)
            x = x * 0.5  # a torch kernel between the Triton ones, as the model has GEMMs
        return x, r

    want = chain(add_rms_norm_ref, x0, r0)
    x_in, r_in = x0.clone(), r0.clone()
    chain(add_rms_norm_triton, x_in, r_in)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(add_rms_norm_triton, x_in, r_in)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
