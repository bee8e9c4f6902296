"""The early PDL trigger in the split-K merge kernel (`kernels/pdl.py`): where it is on,
that the compiled kernel signals before its first global access and nowhere else, and on
the H200 that a programmatic dependent launch after it (`cuda_linear`) still reads the
merged output, in a CUDA graph as eagerly."""
import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from sparseengine.kernels import pdl  # noqa: E402

from .test_gpu_compile import child_env  # noqa: E402

MERGE_TYPES = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32", meta_ptr="*i32",
                   num_splits="i32", stride_ob="i32", stride_oh="i32", HQ="i32")

CHILD = """
import json, sys
from sparseengine.kernels import split_merge
from sparseengine.kernels.testing import compile_for_gpu
out = {}
for trigger in (False, True):
    consts = dict(HEAD_DIM=128, BLOCK_D=32, BLOCK_S=16, STORE_LSE=False, GROUP=4, BALANCED=False, TRIGGER=trigger)
    out[str(trigger)] = compile_for_gpu(split_merge._combine_splits_kernel, None, json.loads(sys.argv[1]), consts,
                                        num_warps=4).asm["ptx"]
print(json.dumps(out))
"""


def test_trigger_is_off_where_there_is_no_griddepcontrol(monkeypatch):
    """The CPU (and the interpreter, which CI runs) has no griddepcontrol; the switch turns it off."""
    assert not pdl.available("cpu") and pdl.trigger_arg("cpu") is False
    monkeypatch.setattr(pdl, "TRIGGER_NEXT", False)
    assert pdl.trigger_arg("cpu") is False


def test_the_merge_kernel_signals_first_when_the_trigger_is_on():
    """sm_90 PTX: with TRIGGER the merge kernel's first global access comes after
    `griddepcontrol.launch_dependents`, which appears once; without it, never. It never waits
    (`griddepcontrol.wait`): it is launched plainly, after the split kernel has finished."""
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(MERGE_TYPES)], capture_output=True, text=True,
                         env=child_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = json.loads(run.stdout.strip().splitlines()[-1])
    assert "griddepcontrol" not in ptx["False"]
    on = ptx["True"]
    assert on.count("griddepcontrol.launch_dependents") == 1 and "griddepcontrol.wait" not in on
    first_global = min(on.index(op) for op in ("ld.global", "st.global") if op in on)
    assert on.index("griddepcontrol.launch_dependents") < first_global


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_a_pdl_linear_after_the_merge_reads_its_output(gen, graph, monkeypatch):
    """Split-K decode (the merge kernel with its trigger) then `cuda_linear` on its output as
    a programmatic dependent launch: equal, bit for bit, to the same chain with the trigger
    off, eagerly and replayed in a CUDA graph whose merge overwrites the output each time."""
    from sparseengine.kernels import cuda_linear as C
    from sparseengine.kernels import paged_decode_triton
    from sparseengine.kernels.testing import random_paged_kv, randn

    reason = C.unavailable("cuda")
    if reason:
        pytest.skip(reason)
    assert pdl.trigger_arg("cuda")
    bf = torch.bfloat16
    kv = random_paged_kv([3000, 2500, 4096], 8, 128, 16, generator=gen, dtype=bf, device="cuda")
    qs = [randn(3, 32, 128, generator=gen, dtype=bf, device="cuda") for _ in range(3)]
    w = randn(4096, 4096, generator=gen, dtype=bf, device="cuda") * 0.02
    q = qs[0].clone()

    def chain():
        att = paged_decode_triton(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, kv_chunk=512, balanced=False)
        return C.cuda_linear(att.reshape(3, 4096), w, pdl=True)

    def want(i):
        monkeypatch.setattr(pdl, "TRIGGER_NEXT", False)
        q.copy_(qs[i])
        y = chain().clone()
        monkeypatch.setattr(pdl, "TRIGGER_NEXT", True)
        return y

    expected = [want(i) for i in range(3)]
    if not graph:
        for i in range(3):
            q.copy_(qs[i])
            assert torch.equal(chain(), expected[i])
        return
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain()  # warm: builds, first launches
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            y = chain()
    for i in (1, 0, 2):
        q.copy_(qs[i])
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, expected[i])
