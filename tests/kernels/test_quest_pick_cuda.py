"""`quest_pick_cuda` (Quest's page scores and choice in one CUDA launch) against the two
launches it joins (`quest_page_scores_cuda`, then `quest_select_pages_cuda` over its scores):
the same scores, pages and counts bit for bit, with and without the decode step's fold (its
bounds as the minmax update makes them), through the choice's warp path and its block path
(scores full of ties), with a row a CTA and with several (more rows than CTAs fit at once),
CTAs that only choose (fewer work items than rows), PDL on and off, one or two CTAs an SM,
replayed in a CUDA graph; the counters left zero after every launch; a count that never
completes failing the launch (no hang); Quest's decode step with it (the tokens of the two
launches, eager and in graphs). On the CPU: the build (where nvcc
is), the errors for bad input (its ctypes table: test_nvcc_build.py)."""
import pytest
import torch

from sparseengine.kernels import quest_pick_cuda as QP
from sparseengine.kernels import quest_scores_cuda as QS
from sparseengine.kernels import quest_select_cuda as QC
from sparseengine.kernels.nvcc_build import find_nvcc
from sparseengine.kernels.testing import random_paged_kv, randn

from .test_quest import _decode_step, _read, _with_padding_row
from .test_quest_scores_cuda import _TORCH_EMPTY, _cuda_cache, decode_step_128k, quest_engine_tokens, quest_model_dir
from .test_quest_select import _poison_torch_empty  # noqa: F401 (the fixture: outputs start poisoned)

# (Hq, Hkv, d, page_size, kv_lens, (sink, recent, budget)): the scores' shapes with choices that take some middle
# pages, none (a request within the total), or every middle page
CASES = [
    (32, 8, 128, 16, [3000, 170, 1, 1290], (16, 32, 256)),
    (8, 2, 128, 4, [900, 7, 300, 64], (4, 8, 64)),
    (8, 8, 128, 16, [2000], (0, 0, 160)),
    (24, 8, 128, 16, [5000, 33], (64, 64, 512)),
    (64, 8, 128, 16, [1000, 2600], (16, 0, 128)),
    (4, 1, 128, 16, [700, 21000], (16, 48, 1024)),
    (12, 4, 128, 8, [2500, 3, 900], (8, 16, 96)),
]


def _id(case):
    hq, hkv, _, ps, lens, choice = case
    return f"hq{hq}-hkv{hkv}-ps{ps}-b{len(lens)}-{'_'.join(map(str, choice))}"


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (no GPU needed: the library loads without one)")
def test_builds_and_reports_its_widest_row(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEENGINE_CACHE", str(tmp_path))
    QP._library.cache_clear()
    try:
        assert QP.library().se_quest_pick_max_pages() == QC.max_pages()
    finally:
        QP._library.cache_clear()
    assert list(tmp_path.glob("cuda/*/libse_quest_pick.so"))


def test_bad_input():
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    hi = torch.zeros(10, 2, 128, dtype=torch.bfloat16)
    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    args = (q, hi, hi.clone(), table, lens, 4, 4, 4, 8)
    call = QP.quest_pick_cuda
    with pytest.raises(ValueError, match="quest_pick_cuda takes head_dim 128, got 64"):
        call(q[..., :64], hi[..., :64], hi[..., :64], table, lens, 4, 4, 4, 8)
    with pytest.raises(ValueError, match=r"page_table must be an int32 \[B=2, P\] tensor"):
        call(q, hi, hi, table.long(), lens, 4, 4, 4, 8)
    with pytest.raises(ValueError, match="pdl=True needs the fold"):
        call(*args, pdl=True)
    with pytest.raises(ValueError, match="sink_tokens must be an integer >= 0, got -1"):
        call(*args[:6], -1, 4, 8)
    with pytest.raises(ValueError, match="budget must be an integer >= 0, got 2.5"):
        call(*args[:8], 2.5)
    for ctas in (0, 3, True):
        with pytest.raises(ValueError, match=f"ctas_per_sm must be 1 or 2 .*, got {ctas}"):
            call(*args, ctas_per_sm=ctas)
    wide = torch.zeros(2, QC.max_pages() + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"takes 1 to {QC.max_pages()} pages a row, got P={QC.max_pages() + 1}"):
        call(q, hi, hi, wide, lens, 4, 4, 4, 8)
    with pytest.raises(ValueError, match=r"l2_prefetch must be one of \(0, 64, 128, 256\), got 32"):
        call(*args, l2_prefetch=32)
    for counters in (torch.zeros(3, dtype=torch.int32), torch.zeros(4), torch.zeros(2, 2, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"counters must be a contiguous int32 vector of at least 2 x B = 4"):
            call(*args, counters=counters)
    with pytest.raises(RuntimeError, match="quest_pick_cuda cannot run: needs a CUDA device, got cpu"):
        call(*args)
    assert not QP.takes(q, hi, 3)


# ---------------------------------------------------------------------------- on the GPU


def _two_launches(q, hi, lo, table, lens, ps, choice, **fold):
    """The scores' launch, then the choice's over its scores (bounds folded in place)."""
    scores = QS.quest_page_scores_cuda(q, hi, lo, table, lens, ps, **fold)
    return (*QC.quest_select_pages_cuda(scores, lens, ps, *choice), scores)


def _assert_same(got, want, lens, ps, where=""):
    pages, counts, scores = got
    assert torch.equal(counts, want[1]), where
    assert torch.equal(pages, want[0]), where
    # bit for bit, NaN where the two launches have NaN (a padding row reads page 0's bounds, NaN in a fresh pool)
    torch.testing.assert_close(_read(scores, lens, ps), _read(want[2], lens, ps), rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"{where}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_equals_the_two_launches(case, gen):
    hq, hkv, d, ps, lens, (sink, recent, budget) = case
    _, args = _cuda_cache((hq, hkv, d, ps, lens), gen)
    q, hi, lo, table, kv_lens, _ = args
    counters = QP.workspace(len(lens), "cuda")
    for lens_dtype in (torch.int32, torch.int64):
        n = kv_lens.to(lens_dtype)
        want = _two_launches(q, hi, lo, table, n, ps, (sink, recent, budget))
        for ctas in (1, 2):
            got = QP.quest_pick_cuda(q, hi, lo, table, n, ps, sink, recent, budget, counters=counters,
                                     ctas_per_sm=ctas, return_scores=True)
            _assert_same(got, want, n, ps, (lens_dtype, ctas))
            assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES[:4], ids=_id)
def test_fold_the_step_keys(case, gen):
    """The decode step's keys folded into their pages' bounds as the minmax update makes
    them, then the same choice as the two launches on those bounds; a padding row (slot -1)
    folds nothing; with PDL and without."""
    hq, hkv, d, ps, lens, choice = case
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=torch.bfloat16, device="cuda")
    (hi, lo), (want_hi, want_lo), last = _decode_step(kv, gen, "cuda")
    table, kv_lens, slots = _with_padding_row(kv, last)
    q = randn(len(lens) + 1, hq, d, generator=gen, dtype=torch.bfloat16, device="cuda")
    want = _two_launches(q, want_hi.clone(), want_lo.clone(), table, kv_lens, ps, choice)
    for pdl in (False, True):
        bounds = (hi.clone(), lo.clone())
        torch.cuda.synchronize()  # a PDL launch may load the bounds before the clones' kernels end
        got = QP.quest_pick_cuda(q, *bounds, table, kv_lens, ps, *choice, k_cache=kv.k_cache, new_slots=slots,
                                 pdl=pdl, return_scores=True)
        torch.testing.assert_close(bounds[0], want_hi, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(bounds[1], want_lo, rtol=0, atol=0, equal_nan=True)
        _assert_same(got, want, kv_lens, ps, pdl)


@pytest.mark.gpu
def test_ties_take_the_block_path(gen):
    """Bounds of two values and one query for every head: each request's middle pages all score
    alike but for a few, so over 512 candidates reach the threshold and the block's search
    decides (ties to the earlier page), as in the choice's own launch."""
    B, P, hq, hkv, d, ps = 3, 2000, 32, 8, 128, 16
    pool = B * P
    table = torch.randperm(pool, generator=gen)[: B * P].view(B, P).int().cuda()
    lens = torch.tensor([P * ps, 20000, 1500], dtype=torch.int32, device="cuda")
    hi = torch.ones(pool, hkv, d, dtype=torch.bfloat16, device="cuda")
    hi[torch.randperm(pool, generator=gen)[:40]] = 2.0  # a few pages above the rest
    lo = -hi
    q = torch.ones(B, hq, d, dtype=torch.bfloat16, device="cuda")
    choice = (64, 512, 2048)
    want = _two_launches(q, hi, lo, table, lens, ps, choice)
    got = QP.quest_pick_cuda(q, hi, lo, table, lens, ps, *choice, return_scores=True)
    _assert_same(got, want, lens, ps)


@pytest.mark.gpu
def test_more_rows_than_ctas_and_ctas_that_only_choose(gen):
    """40 requests x 8 KV heads = 320 rows, more than an H200 holds CTAs at once (2 on each of
    132 SMs): CTAs take several rows each; then 20 requests of at most 64 pages (80 work
    items for 160 rows): CTAs past the scoring ones only choose."""
    hq, hkv, d, ps = 32, 8, 128, 16
    for B, P in ((40, 2000), (20, 64)):
        top = P * ps
        lens = torch.randint(1, top + 1, (B,), generator=gen)
        lens[:3] = torch.tensor([1, top, top - 7])
        table = torch.randperm(B * P, generator=gen).view(B, P).int().cuda()
        hi = torch.randn(B * P, hkv, d, generator=gen).bfloat16().cuda()
        lo = hi - torch.rand(B * P, hkv, d, generator=gen).bfloat16().cuda()
        q = torch.randn(B, hq, d, generator=gen).bfloat16().cuda()
        lens = lens.int().cuda()
        choice = (16, 64, 256)
        counters = QP.workspace(B, "cuda")
        want = _two_launches(q, hi, lo, table, lens, ps, choice)
        got = QP.quest_pick_cuda(q, hi, lo, table, lens, ps, *choice, counters=counters, return_scores=True)
        _assert_same(got, want, lens, ps, P)
        assert not counters.any()


@pytest.mark.gpu
def test_128k_shape_in_a_cuda_graph(gen):
    """The 128K benchmark's shape (6 requests, 8320-page tables, 32 query / 8 KV heads, total
    2048), a decode step's fold: eager with and without PDL (and the build asking L2 for 256 B
    around each load of the bounds), then captured once and replayed
    three times with the bounds restored before each: the same pages, counts and scores as the
    two launches every time, the counters zero after each replay."""
    q, hi, lo, table, lens, fold, (want_hi, want_lo) = decode_step_128k(gen)
    ps = 16
    choice = (64, 512, 1472)
    want = _two_launches(q, want_hi.clone(), want_lo.clone(), table, lens, ps, choice)
    counters = QP.workspace(8, "cuda")
    for pdl, prefetch in ((False, 0), (True, 0), (True, 256)):
        bounds = (hi.clone(), lo.clone())
        torch.cuda.synchronize()
        got = QP.quest_pick_cuda(q, *bounds, table, lens, ps, *choice, **fold, counters=counters, pdl=pdl,
                                 l2_prefetch=prefetch, return_scores=True)
        assert torch.equal(bounds[0], want_hi) and torch.equal(bounds[1], want_lo)
        _assert_same(got, want, lens, ps, (pdl, prefetch))
        assert not counters.any()
    bounds = (hi.clone(), lo.clone())
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        QP.quest_pick_cuda(q, *bounds, table, lens, ps, *choice, **fold, counters=counters)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = QP.quest_pick_cuda(q, *bounds, table, lens, ps, *choice, **fold, counters=counters,
                                     return_scores=True)
    for _ in range(3):
        bounds[0].copy_(hi), bounds[1].copy_(lo)
        out[0].fill_(-7), out[1].fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(out, want, lens, ps, "replay")
        assert torch.equal(bounds[0], want_hi) and torch.equal(bounds[1], want_lo)
        assert not counters.any()


_NEVER_COMPLETE = """
import torch
from sparseengine.kernels import quest_pick_cuda as QP
B, P, hkv = 2, 64, 8
q = torch.randn(B, 32, 128, device="cuda").bfloat16()
hi = torch.randn(B * P, hkv, 128, device="cuda").bfloat16()
table = torch.arange(B * P, device="cuda").view(B, P).int()
lens = torch.full((B,), P * 16, dtype=torch.int32, device="cuda")
counters = QP.workspace(B, "cuda")
counters[:B] = -1000  # request counts that never complete
QP.quest_pick_cuda(q, hi, hi - 1, table, lens, 16, 16, 32, 128, counters=counters)
torch.cuda.synchronize()
print("returned")
"""


@pytest.mark.gpu
def test_a_count_that_never_completes_fails_the_launch():
    """The rows' wait is bounded: with counters that never reach a request's count (a broken
    workspace), the launch traps after ~2 s and the process sees a CUDA error, not a hung GPU
    (a child process: the error leaves its CUDA context unusable)."""
    import subprocess
    import sys
    import time

    from sparseengine.kernels.testing import child_env

    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", _NEVER_COMPLETE], capture_output=True, text=True, env=child_env(),
                         timeout=120)
    assert run.returncode != 0 and "returned" not in run.stdout, (run.stdout, run.stderr[-2000:])
    assert "CUDA error" in run.stderr or "AcceleratorError" in run.stderr, run.stderr[-2000:]
    assert time.monotonic() - start < 60


@pytest.mark.gpu
def test_in_the_engine(tmp_path, monkeypatch):
    """A model the kernels take (`quest_model_dir`): with `ENGINE` on, Quest's decode step picks
    with it, the records say so, and its tokens are the two launches', eager and in decode
    graphs alike."""
    monkeypatch.setattr(torch, "empty", _TORCH_EMPTY)  # the engine allocates with the real torch.empty
    model = quest_model_dir(tmp_path)
    calls, real = [], QP.quest_pick_cuda
    monkeypatch.setattr(QP, "quest_pick_cuda", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens = {}
    for on in (False, True):
        monkeypatch.setattr(QP, "ENGINE", on)
        for eager in (True, False):
            calls.clear()

            def check_kernels(kernels):
                assert (kernels["quest_scores"] == "cuda pick") == on, kernels

            tokens[on, eager] = quest_engine_tokens(model, eager, check_kernels)
            assert bool(calls) == on, (on, eager)
            if on and eager:
                assert len(calls) >= 20, len(calls)  # every eager decode step's sparse layer
    assert tokens[True, True] == tokens[False, True] and tokens[True, False] == tokens[False, False]
