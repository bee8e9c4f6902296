"""The CUDA C kernels' build (`nvcc_build`), on the CPU: each wrapper's ctypes table against
its source's `extern "C"` declarations, parameter by parameter (a float passed without a
signature fails at the call; a pointer passed as an int is truncated), and a library keyed
by the headers beside its source as well as the source; ptxas's report of the builds the
engine and its A/Bs run: no spills (`ptxas_usage`)."""
import pytest

from sparseengine.kernels import (cuda_linear, omnikv_select_cuda, quest_scores_cuda, quest_select_cuda,
                                  sparse_attention_cuda)
from sparseengine.kernels.nvcc_build import declared_signatures, find_nvcc, load_library, patch_once, patched_copy


@pytest.mark.parametrize("wrapper", [cuda_linear, quest_select_cuda, quest_scores_cuda,
                                     sparse_attention_cuda, omnikv_select_cuda],
                         ids=lambda m: m.__name__)
def test_ctypes_signatures_match_the_source(wrapper):
    declared = declared_signatures(wrapper.SOURCE)
    assert declared and set(declared) == set(wrapper.SIGNATURES)
    for name, (ret, args) in declared.items():
        assert wrapper.SIGNATURES[name] == (ret, args), name


def test_the_rope_entry_point_is_declared():
    assert "se_linear_rope" in declared_signatures(cuda_linear.SOURCE)


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (no GPU needed: the library loads without one)")
def test_probe_patches(tmp_path):
    """A probe's patch applies once or stops it; a patched copy rewrites only the files named, and names no others."""
    assert patch_once("a; b; c;", "b;", "b; x;", "f.cu") == "a; b; x; c;"
    for text, times in (("a;", 0), ("b; b;", 2)):
        with pytest.raises(ValueError, match=rf"patch does not match f.cu once \({times} times\): 'b;'"):
            patch_once(text, "b;", "x", "f.cu")
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    for name, text in (("k.cu", "source"), ("h.cuh", "header"), ("g.cuh", "other"), ("x.py", "not copied")):
        (kernels / name).write_text(text)
    copy = patched_copy(kernels / "k.cu", {"h.cuh": "patched"}, tmp_path / "copy")
    assert copy == tmp_path / "copy" / "k.cu"
    assert {f.name: f.read_text() for f in copy.parent.iterdir()} == {"k.cu": "source", "h.cuh": "patched",
                                                                      "g.cuh": "other"}
    with pytest.raises(ValueError, match=r"not k.cu or a header beside it: \['x.py'\]"):
        patched_copy(kernels / "k.cu", {"x.py": ""}, tmp_path / "again")


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


def _builds():
    from sparseengine.kernels.bench_cuda_linear import GRID_BUILDS

    yield "cuda_linear engine", cuda_linear.SOURCE, cuda_linear.build_flags(cuda_linear._build())
    for name, build in GRID_BUILDS.items():
        yield f"cuda_linear {name}", cuda_linear.SOURCE, cuda_linear.build_flags(build)
    for prefetch in quest_scores_cuda.L2_PREFETCH_SIZES:
        yield f"quest_scores l2 {prefetch}", quest_scores_cuda.SOURCE, quest_scores_cuda.build_flags(prefetch)
    yield "quest_select", quest_select_cuda.SOURCE, []
    yield "omnikv_select", omnikv_select_cuda.SOURCE, []
    attention = sparse_attention_cuda
    for stages in attention.STAGE_CHOICES:
        yield f"sparse_attention {stages} stages", attention.SOURCE, attention.build_flags(stages)


# Spills ptxas reports and that are known: quest_select's 4-keys-a-thread float4 build (rows
# of at most 1024 pages, not the 128K table's 36 keys) keeps 16 bytes on the stack.
KNOWN_SPILLS = {"select_kernelILi4ELb1E": (20, 36)}  # (stores, loads) in bytes


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (no GPU needed: ptxas reports at build time)")
@pytest.mark.parametrize("name,source,flags", list(_builds()), ids=[b[0] for b in _builds()])
def test_engine_builds_keep_their_registers(name, source, flags):
    """Every kernel of the builds the engine (and its grid A/B) runs, in registers: ptxas
    reports no spill stores or loads (a spill in a decode kernel's loop costs far more than
    its bytes: session 45's 2-CTA linears ran at half speed), except the known one above,
    which must not grow."""
    from sparseengine.kernels.nvcc_build import ptxas_usage

    usage = ptxas_usage(source, flags)
    assert usage, f"{name}: ptxas reported no function"
    for fn, u in usage.items():
        stores, loads = next((v for k, v in KNOWN_SPILLS.items() if k in fn), (0, 0))
        assert u["spill_stores"] <= stores and u["spill_loads"] <= loads, f"{name}: {fn} {u}"
        assert 0 < u["registers"] <= 255, f"{name}: {fn} {u}"
