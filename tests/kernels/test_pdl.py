"""`kernels/pdl.py` in Triton kernels. The early trigger in the split-K merge kernel: where
it is on, that the compiled kernel signals before its first global access and nowhere else,
and on the H200 that a programmatic dependent launch after it (`cuda_linear`) still reads
the merged output, in a CUDA graph as eagerly. The wait in Quest's page scores launched
with PDL: the sm_90 build issues its first tile's loads before it."""
import pytest
import torch

pytest.importorskip("triton")

from sparseengine.kernels import pdl  # noqa: E402
from sparseengine.kernels.testing import ptx_in_child, record_launches  # noqa: E402

MERGE_TYPES = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32", meta_ptr="*i32",
                   num_splits="i32", stride_ob="i32", stride_oh="i32", HQ="i32")


def test_trigger_is_off_where_there_is_no_griddepcontrol(monkeypatch):
    """The CPU (and the interpreter, which CI runs) has no griddepcontrol; the switch turns it off."""
    assert not pdl.available("cpu") and pdl.trigger_arg("cpu") is False
    monkeypatch.setattr(pdl, "TRIGGER_NEXT", False)
    assert pdl.trigger_arg("cpu") is False


def test_the_merge_kernel_signals_first_when_the_trigger_is_on():
    """sm_90 PTX: with TRIGGER the merge kernel's first global access comes after
    `griddepcontrol.launch_dependents`, which appears once; without it, never. It never waits
    (`griddepcontrol.wait`): it is launched plainly, after the split kernel has finished."""
    consts = dict(HEAD_DIM=128, BLOCK_D=32, BLOCK_S=16, STORE_LSE=False, GROUP=4, BALANCED=False)
    ptx = ptx_in_child({str(trigger): dict(module="sparseengine.kernels.split_merge", kernel="_combine_splits_kernel",
                                           types=MERGE_TYPES, constexprs=dict(consts, TRIGGER=trigger))
                        for trigger in (False, True)})
    assert "griddepcontrol" not in ptx["False"]
    on = ptx["True"]
    assert on.count("griddepcontrol.launch_dependents") == 1 and "griddepcontrol.wait" not in on
    first_global = min(on.index(op) for op in ("ld.global", "st.global") if op in on)
    assert on.index("griddepcontrol.launch_dependents") < first_global


def test_quest_scores_pdl_build_issues_the_first_tile_before_its_wait(device):
    """Quest's page scores as a PDL launch at the engine's tiling (tiles of 64 pages, two a
    program, bf16, GQA 4): built for sm_90 with the wait, the kernel waits once, and the
    first tile's bounds go out (cp.async, in the entry block: the prologue of the
    pipelined loop) before griddepcontrol.wait, which is what the launch is for. The
    loop's blocks are laid out before the wait's in the PTX text, so the text's order is
    checked up to the first branch only."""
    from sparseengine.kernels import quest_page_scores_triton
    from sparseengine.kernels.testing import random_paged_kv, randn

    gen = torch.Generator().manual_seed(0)
    kv = random_paged_kv([300, 290], 8, 128, 16, generator=gen, dtype=torch.bfloat16, device=device)
    q = randn(2, 32, 128, generator=gen, dtype=torch.bfloat16, device=device)
    kmax = kv.k_cache.new_zeros(kv.k_cache.shape[0], 8, 128)
    slots = torch.stack([kv.slots(0)[-1], kv.slots(1)[-1]])
    with record_launches() as rec:
        quest_page_scores_triton(q, kmax, kmax.clone(), kv.page_table, kv.kv_lens, 16, k_cache=kv.k_cache,
                                 new_slots=slots, pdl=True)
    build = rec.launches[0]
    assert build["constexprs"]["LATE"] and build["constexprs"]["BLOCK_P"] == 64
    build["constexprs"]["PDL"] = True  # the interpreter has no griddepcontrol: the GPU's build
    # as a launch at the 128K shape specialises: 16-byte aligned pointers, strides of whole 16-element runs
    build["aligned"] = [n for n, t in build["types"].items() if t.startswith("*")] + [
        "stride_qb", "stride_qh", "stride_mp", "stride_mh", "stride_kp", "stride_ko", "stride_kh"]
    lines = ptx_in_child({"pdl": build})["pdl"].splitlines()
    order = {name: [i for i, line in enumerate(lines) if text in line] for name, text in (
        ("wait", "griddepcontrol.wait"), ("copies", "cp.async.cg"), ("loads", "ld.global"), ("branches", "bra"))}
    assert len(order["wait"]) == 1, order
    loop = [i for i in order["branches"] if i > order["copies"][0]][0]  # the prologue's end
    entry = [i for i in order["copies"] if i < loop]
    # a thread's share of one tile's bounds: 64 pages x 128 channels x (max, min) x 2 bytes / 128 threads / 16 B
    assert len(entry) == 64 * 128 * 2 * 2 // 128 // 16 and loop < order["wait"][0], order
    assert len([i for i in order["loads"] if i < loop]) <= 2 + 64 // 8, order  # length, slot, page ids (4 B each)


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
