"""The CUDA C kernels' build (`nvcc_build`), on the CPU: each wrapper's ctypes table against
its source's `extern "C"` declarations, parameter by parameter (a float passed without a
signature fails at the call; a pointer passed as an int is truncated), and a library keyed
by the headers beside its source as well as the source."""
import pytest

from sparseengine.kernels import cuda_linear, quest_scores_cuda, quest_select_cuda, sparse_attention_cuda
from sparseengine.kernels.nvcc_build import declared_signatures, find_nvcc, load_library


@pytest.mark.parametrize("wrapper", [cuda_linear, quest_select_cuda, quest_scores_cuda,
                                     sparse_attention_cuda],
                         ids=lambda m: m.__name__)
def test_ctypes_signatures_match_the_source(wrapper):
    declared = declared_signatures(wrapper.SOURCE)
    assert declared and set(declared) == set(wrapper.SIGNATURES)
    for name, (ret, args) in declared.items():
        assert wrapper.SIGNATURES[name] == (ret, args), name


def test_the_rope_entry_point_is_declared():
    assert "se_linear_rope" in declared_signatures(cuda_linear.SOURCE)


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (no GPU needed: the library loads without one)")
def test_a_header_edit_rebuilds(monkeypatch, tmp_path):
    """An edited header (`mma_bf16.cuh`, which `quest_scores.cu` includes) builds a new
    library, not the cached one."""
    source = quest_scores_cuda.SOURCE
    src = tmp_path / "src"
    src.mkdir()
    for f in [source, *source.parent.glob("*.cuh")]:
        (src / f.name).write_text(f.read_text())
    monkeypatch.setenv("SPARSEENGINE_CACHE", str(tmp_path / "cache"))
    build = lambda: load_library(src / source.name, [], "lib.so", quest_scores_cuda.SIGNATURES, "t")._name  # noqa: E731
    first = build()
    assert build() == first
    with open(src / "mma_bf16.cuh", "a") as f:
        f.write("// edited\n")
    assert build() != first
