"""`sparse_attention_cuda` (the attention over Quest's pages and OmniKV's pool rows in one
CUDA launch) against the torch references (`sparse_page_decode_ref`,
`sparse_rows_decode_ref`) on fresh random bf16 caches: GQA groups 1 to 8, partial last
pages, counts of 0 (a zero output, lse -inf), entries to skip (-1, pages past the request),
a selection shared by the KV heads (stride 0), every split count; equal to the Triton
kernels at the 128K benchmark's Quest shape, in a CUDA graph; and the Triton provider
taking it for a page and a rows selection. On the CPU: the errors for bad input, the split
count, `takes`, and the build (where nvcc is); its ctypes table: test_nvcc_build.py."""
import pytest
import torch

from sparseengine.kernels import sparse_attention_cuda as SA
from sparseengine.kernels import (sparse_page_decode_ref, sparse_page_decode_triton, sparse_rows_decode_ref,
                                  sparse_rows_decode_triton)
from sparseengine.kernels.nvcc_build import find_nvcc
from sparseengine.kernels.testing import assert_close, random_paged_kv, randn

from .test_sparse_decode import _page_selection, _token_selection, pool_rows_of

# (Hq, Hkv, kv_lens, pages chosen a row at most): groups 1, 2, 4, 8; lengths off the page
CASES = [(8, 8, [300], 9), (8, 4, [37, 1, 700], 20), (32, 8, [1000, 129], 40), (16, 2, [2500], 129)]
TOL = 1e-2  # bf16 probabilities in P V against the reference's float32


def _case(case, gen, device="cuda"):
    hq, hkv, lens, width = case
    kv = random_paged_kv(lens, hkv, 128, 16, generator=gen, dtype=torch.bfloat16, device=device)
    return randn(len(lens), hq, 128, generator=gen, dtype=torch.bfloat16, device=device), kv


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_pages_equal_the_reference(case, gen):
    q, kv = _case(case, gen)
    idx, num = _page_selection(case[2], case[1], 16, case[3], gen, "cuda")
    idx[..., -1] = 10**6  # a page past every request (skipped where counted)
    num[-1, -1] = 0  # nothing attended: zero output, lse -inf
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, idx.long(), num)
    out_ref, lse_ref = sparse_page_decode_ref(*args, return_lse=True)
    assert torch.isinf(lse_ref[-1, -1]) and not out_ref[-1, -1].any()
    for splits, stages in ((None, None), (1 if case[3] <= 64 else 3, 2), (5, 3), (8, 4)):  # a CTA: 64 chunks at most
        out, lse = SA.sparse_page_decode_cuda(*args, return_lse=True, splits=splits, stages=stages)
        assert_close(out, out_ref, TOL, f"out, splits={splits}")
        assert_close(lse, lse_ref, 1e-4, f"lse, splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_rows_equal_the_reference(case, gen):
    q, kv = _case(case, gen)
    hq, hkv, lens, width = case
    idx, num = _token_selection(lens, hkv, 16 * width - 5, gen, "cuda")
    rows = pool_rows_of(kv.page_table, idx, num, 16)
    rows[:, :, 1] = -1  # skipped wherever it counts
    base = (q, kv.k_cache, kv.v_cache)
    out_ref, lse_ref = sparse_rows_decode_ref(*base, rows, num, return_lse=True)
    for splits, stages in ((None, None), (3, 2), (5, 3), (8, 4)):  # 3 CTAs take the 129-entry case's 129 chunks
        out, lse = SA.sparse_rows_decode_cuda(*base, rows.long() if splits == 3 else rows, num, return_lse=True,
                                              splits=splits, stages=stages)
        assert_close(out, out_ref, TOL, f"out, splits={splits}")
        assert_close(lse, lse_ref, 1e-4, f"lse, splits={splits}")
    shared, shared_num = rows[:, :1].expand_as(rows), num[:, :1].expand_as(num)  # OmniKV's one choice a request
    assert_close(SA.sparse_rows_decode_cuda(*base, shared, shared_num),
                 sparse_rows_decode_ref(*base, shared, shared_num), TOL, "shared")


@pytest.mark.gpu
@pytest.mark.parametrize("trigger", [False, True])
def test_the_128k_quest_shape_equals_triton_in_a_graph(trigger, gen):
    """b=6, 8 KV heads of 4 query heads, 129 chosen pages of a 128K cache (as the benchmark):
    the CUDA launch, replayed in a CUDA graph, gives the Triton page kernel's output."""
    from sparseengine.kernels.bench_quest import _chosen_pages_case

    args, _, _ = _chosen_pages_case(6, 8320, 131072, 129)
    want = sparse_page_decode_triton(*args).float()
    assert_close(SA.sparse_page_decode_cuda(*args, trigger=trigger), want, TOL, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = SA.sparse_page_decode_cuda(*args, trigger=trigger)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, want, TOL, "graph")
    q, k_cache, v_cache, table, kv_lens, pages, counts = args
    rows = pool_rows_of(table, (pages[..., None] * 16 + torch.arange(16, device="cuda")).flatten(-2),
                        counts * 16, 16)
    assert_close(SA.sparse_rows_decode_cuda(q, k_cache, v_cache, rows, counts * 16),
                 sparse_rows_decode_triton(q, k_cache, v_cache, table, kv_lens, rows, counts * 16), TOL, "rows")


@pytest.mark.gpu
def test_the_triton_provider_attends_with_it(monkeypatch, gen):
    """With `ENGINE` on, the provider's sparse decode runs it for a page and a rows selection
    (bf16, head dim 128, pages of 16), and the Triton kernels' output with it turned off."""
    from sparseengine.attention.triton_provider import TritonAttentionProvider
    from sparseengine.engine.step_context import Selection

    monkeypatch.setattr(SA, "ENGINE", True)  # off by default (the step was slower with it, session 56)
    q, kv = _case(CASES[2], gen)
    idx, num = _page_selection(CASES[2][2], 8, 16, 40, gen, "cuda")
    tok, tnum = _token_selection(CASES[2][2], 8, 300, gen, "cuda")
    provider, args = TritonAttentionProvider(), (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    pages = Selection(idx.long(), num, (False, False), page_size=16)
    rows = Selection(tok.long(), tnum, (False, False), pool_rows=pool_rows_of(kv.page_table, tok, tnum, 16))
    assert SA.takes(q, kv.k_cache, 40, pages=True) and SA.takes(q, kv.k_cache, 300, pages=False)
    assert provider.ops()["sparse_decode"].startswith("cuda where it takes")  # what the records say
    calls = []
    for name in ("sparse_page_decode_cuda", "sparse_rows_decode_cuda"):
        monkeypatch.setattr(SA, name, lambda *a, _f=getattr(SA, name), **k: calls.append(_f) or _f(*a, **k))
    got = [provider._sparse_decode(*args, s) for s in (pages, rows)]
    assert len(calls) == 2
    monkeypatch.setattr(SA, "ENGINE", False)
    assert provider.ops()["sparse_decode"] == "triton"
    want = [provider._sparse_decode(*args, s) for s in (pages, rows)]
    assert len(calls) == 2
    for g, w in zip(got, want):
        assert_close(g, w, TOL)


def test_the_records_name_triton_where_it_cannot_run(monkeypatch):
    """Without a CUDA GPU (or with ENGINE off) the provider's sparse decode is Triton's."""
    from sparseengine.attention.triton_provider import TritonAttentionProvider

    if torch.cuda.is_available():
        monkeypatch.setattr(SA, "ENGINE", False)
    assert TritonAttentionProvider().ops()["sparse_decode"] == "triton"


def _cpu_args(hq=8, hkv=2, d=128, ps=16, dtype=torch.bfloat16):
    q = torch.zeros(2, hq, d, dtype=dtype)
    cache = torch.zeros(6, ps, hkv, d, dtype=dtype)
    table = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.tensor([40, 20], dtype=torch.int32)
    sel = torch.zeros(2, hkv, 3, dtype=torch.int64)
    num = torch.ones(2, hkv, dtype=torch.int32)
    return q, cache, cache.clone(), table, lens, sel, num


@pytest.mark.parametrize("change, message", [
    (dict(dtype=torch.float32), "takes bf16"),
    (dict(d=64), "head dim 128"),
    (dict(hq=32, hkv=2), "at most 8 query heads"),
    (dict(ps=8), "pages of 16 tokens"),
])
def test_bad_input_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        SA.sparse_page_decode_cuda(*_cpu_args(**change))


def test_shape_reason_is_what_takes_and_the_wrappers_ask():
    """The shapes the kernel takes (bf16, head dim 128, up to 8 query heads a KV head, a
    contiguous cache, pages of 16 for the page variant, 1 to 8 x 64 chunks a row), each refusal
    named; the rows variant takes any page size."""
    q, k = _cpu_args()[:2]
    assert SA.shape_reason(q, k, 129, pages=True) is None and SA.shape_reason(q, k, 8192, pages=False) is None
    assert "1 to 512 chunks" in SA.shape_reason(q, k, 513, pages=True)
    assert "1 to 512 chunks" in SA.shape_reason(q, k, 8193, pages=False)
    assert "1 to 512 chunks" in SA.shape_reason(q, k, 0, pages=True)
    q8, k8 = _cpu_args(ps=8)[:2]
    assert "pages of 16" in SA.shape_reason(q8, k8, 3, pages=True) and SA.shape_reason(q8, k8, 3, pages=False) is None
    assert "contiguous cache" in SA.shape_reason(q, k.transpose(0, 1), 3, pages=False)
    q3, k3 = _cpu_args(hq=6, hkv=4)[:2]
    assert "Hq a multiple of Hkv" in SA.shape_reason(q3, k3, 3, pages=True)


def test_bad_tables_and_selections_are_refused():
    q, k, v, table, lens, sel, num = _cpu_args()
    with pytest.raises(ValueError, match="page_table must be"):
        SA.sparse_page_decode_cuda(q, k, v, table.long(), lens, sel, num)
    with pytest.raises(ValueError, match="kv_lens must be"):
        SA.sparse_page_decode_cuda(q, k, v, table, lens.float(), sel, num)
    with pytest.raises(ValueError, match="selection must be"):
        SA.sparse_rows_decode_cuda(q, k, v, sel[:, :1], num)
    with pytest.raises(ValueError, match="contiguous"):
        SA.sparse_rows_decode_cuda(q, k.transpose(0, 1), v, sel, num)
    with pytest.raises(RuntimeError, match="cannot run: needs a CUDA device"):
        SA.sparse_rows_decode_cuda(q, k, v, sel, num)
    assert not SA.takes(q, k, 3, pages=True)  # not on a CPU


def test_split_counts():
    """At most 3 CTAs an SM over the grid (what fit at once), at most SPLITS_CAP a row, no more than a chunk a
    warp, at least what 16 chunks a warp need (up to 8 CTAs); none past 8 x 64 chunks."""
    assert SA.splits_for(48, 129, 132) == 4  # Quest b=6 at 128K: at most SPLITS_CAP unless the chunks need more
    assert SA.splits_for(48, 129, 132, cap=8) == 8
    assert SA.splits_for(48, 60, 132, ctas_per_sm=1) == 2  # 96 CTAs: one wave of 132 SMs, not 144
    assert SA.splits_for(48, 129, 132, ctas_per_sm=1) == 3  # 129 chunks need 3 CTAs of 64: past one wave
    assert [SA.ctas_fit(s) for s in SA.STAGE_CHOICES] == [3, 2, 1]
    assert SA.splits_for(160, 128, 132) == 2
    assert SA.splits_for(1000, 129, 132) == 3  # 129 chunks need 3 CTAs of 64
    assert SA.splits_for(2, 5, 132) == 2  # 4 warps a CTA: a chunk each
    assert SA.splits_for(4000, 512, 132) == 8 and SA.splits_for(1, 513, 132) is None
    assert SA.splits_for(1, 300, 132) == 5  # past the cap: what 300 chunks need
    assert SA.chunks_of(2048, pages=False) == 128 and SA.chunks_of(129, pages=True) == 129


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (no GPU needed: the library loads without one)")
def test_builds_and_reports_its_widest_row(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEENGINE_CACHE", str(tmp_path))
    SA._library.cache_clear()
    try:
        for stages in SA.STAGE_CHOICES:
            assert SA.library(stages).se_sparse_attention_max_chunks(8) == SA.MAX_SPLITS * SA.MAX_CHUNKS_PER_SPLIT
    finally:
        SA._library.cache_clear()
    assert len(list(tmp_path.glob("cuda/*/libse_sparse_attention.so"))) == len(SA.STAGE_CHOICES)  # a build each
    with pytest.raises(ValueError, match="stages must be one of"):
        SA.library(5)
