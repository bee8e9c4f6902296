"""`omnikv_select_cuda` (OmniKV's pick in one cluster launch) against the Triton kernel and the
torch path (`pick_tokens`) on distinct scores, and against the per-request definition (ties
to the earlier token) on scores full of ties, keys that differ only below a radix digit, and
a gap right below the budget-th score; with clusters of 8 and 16 CTAs (on the small cases most
CTAs hold no middle token), pool rows, int32 and int64 lengths, the widest row a cluster of 8
takes, and at the 128K benchmark's shape in a CUDA graph, with and without PDL. Scores at or
past a request's `n - recent` are NaN: the contract says they are never read.
On the CPU: the errors for bad input, `takes`/`runs_on` off a GPU, the build (where nvcc is);
its ctypes table and ptxas report: test_nvcc_build.py."""
import pytest
import torch

from sparseengine.kernels import omnikv_select_cuda as OC
from sparseengine.kernels import omnikv_select_triton
from sparseengine.kernels.nvcc_build import find_nvcc, patched_copy, ptxas_usage
from sparseengine.methods.omnikv import pick_tokens

from .test_omnikv_select import (CASES, _case_id, _definition, _poison_torch_empty, _scores,  # noqa: F401 (fixture)
                                 gap_case)

CLUSTERS = [8, 16]


def _pick(scores, lens, sink, budget, recent, **kw):
    return OC.omnikv_select_cuda(scores.cuda(), torch.tensor(lens, device="cuda"), sink, budget, recent, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_distinct_scores_pick_what_triton_and_torch_pick(case, cluster):
    lens, H, L, sink, budget, recent = case
    gen = torch.Generator().manual_seed(len(lens) * 31 + L)
    values = torch.randn(len(lens), H, L, generator=gen)
    scores = _scores(values, lens, recent)
    idx, counts = _pick(scores, lens, sink, budget, recent, cluster=cluster)
    want_idx, want_counts = pick_tokens(values.amax(1), torch.tensor(lens), sink, budget, recent)
    assert idx.dtype == torch.int64 and counts.dtype == torch.int32
    assert torch.equal(counts.cpu(), want_counts)
    assert torch.equal(idx.cpu(), want_idx), (idx.cpu() != want_idx).nonzero()[:5].tolist()
    t_idx, t_counts = omnikv_select_triton(scores.cuda(), torch.tensor(lens, device="cuda"), sink, budget, recent)
    assert torch.equal(idx, t_idx) and torch.equal(counts, t_counts)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", CLUSTERS)
def test_ties_go_to_the_earlier_token(cluster):
    """Scores of 3 values: most of the budget is ties (split across CTAs), -0.0 ties with +0.0."""
    lens, sink, budget, recent = [400, 257, 90, 30], 8, 40, 16
    gen = torch.Generator().manual_seed(11)
    values = torch.randint(0, 3, (len(lens), 2, 400), generator=gen).float() - 1.0
    values[1, :, 100] = 0.0
    values[1, 1, 100] = -0.0
    idx, counts = _pick(_scores(values, lens, recent), lens, sink, budget, recent, cluster=cluster)
    assert counts.tolist() == [min(n, sink + budget + recent) for n in lens]
    assert idx.cpu().tolist() == _definition(values, lens, sink, budget, recent)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", CLUSTERS)
def test_a_gap_right_below_the_budget_th_score(cluster):
    values, lens, sink, budget, recent = gap_case()
    idx, _ = _pick(_scores(values, lens, recent), lens, sink, budget, recent, cluster=cluster)
    assert idx.cpu().tolist() == _definition(values, lens, sink, budget, recent)


@pytest.mark.gpu
@pytest.mark.parametrize("low", [8, 10, 16, 21, 24])
def test_keys_that_differ_only_below_a_digit(low):
    """Positive scores sharing every key bit from `low` up: the passes above settle nothing,
    the threshold is decided at and below `low`, with repeated keys (ties)."""
    lens, sink, budget, recent = [7000, 6500], 4, 600, 8
    gen = torch.Generator().manual_seed(low * 3)
    base = torch.tensor(1.5).view(torch.int32) & ~((1 << low) - 1)
    low_bits = torch.randint(0, 1 << low, (2, 1, 7000), generator=gen, dtype=torch.int32)
    low_bits[:, :, 1::7] = low_bits[:, :, 2::7][..., : low_bits[:, :, 1::7].shape[-1]]
    values = (base | low_bits).view(torch.float32)
    idx, _ = _pick(_scores(values, lens, recent), lens, sink, budget, recent)
    assert idx.cpu().tolist() == _definition(values, lens, sink, budget, recent)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", CLUSTERS)
def test_pool_rows_and_int64_lengths(cluster):
    """With a page table: each chosen token's pool row (-1 past a request's count), as the
    Triton kernel gives them; kv_lens int32 or int64; a table that is not int32 is refused."""
    lens, H, L, sink, budget, recent = CASES[3]
    gen = torch.Generator().manual_seed(5)
    scores = _scores(torch.randn(len(lens), H, L, generator=gen), lens, recent).cuda()
    ps, pages = 16, -(-L // 16)
    table = torch.stack([torch.randperm(len(lens) * pages, generator=gen)[:pages] for _ in lens]).int().cuda()
    want = omnikv_select_triton(scores, torch.tensor(lens, device="cuda"), sink, budget, recent, page_table=table,
                                page_size=ps)
    for dtype in (torch.int32, torch.int64):
        got = OC.omnikv_select_cuda(scores, torch.tensor(lens, device="cuda", dtype=dtype), sink, budget, recent,
                                    page_table=table, page_size=ps, cluster=cluster)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), dtype
    with pytest.raises(ValueError, match="page_table must be int32"):
        OC.omnikv_select_cuda(scores, torch.tensor(lens, device="cuda"), sink, budget, recent,
                              page_table=table.long(), page_size=ps)


@pytest.mark.gpu
def test_no_budget_and_a_width_within_the_total():
    gen = torch.Generator().manual_seed(2)
    lens = [100, 33]
    values = torch.randn(2, 120, generator=gen)
    idx, _ = _pick(values, lens, 4, 0, 6)
    assert torch.equal(idx.cpu(), pick_tokens(values, torch.tensor(lens), 4, 0, 6)[0])
    idx, counts = _pick(values[:, :20], lens, 4, 10, 6)
    assert idx.cpu().tolist() == [list(range(20))] * 2 and counts.tolist() == [20, 20]


@pytest.mark.gpu
def test_the_widest_row_of_a_cluster_of_8():
    L = OC.max_tokens(8)
    lens, sink, budget, recent = [L, L - 1000], 64, 4096, 512
    gen = torch.Generator(device="cuda").manual_seed(3)
    values = torch.randn(2, 1, L, generator=gen, device="cuda")
    idx, counts = OC.omnikv_select_cuda(values, torch.tensor(lens, device="cuda"), sink, budget, recent, cluster=8)
    want_idx, want_counts = pick_tokens(values[:, 0], torch.tensor(lens, device="cuda"), sink, budget, recent)
    assert torch.equal(idx, want_idx) and torch.equal(counts, want_counts)
    with pytest.raises(ValueError, match=f"rows of at most {L} tokens"):
        OC.omnikv_select_cuda(torch.zeros(1, L + 1, device="cuda"), torch.tensor([5], device="cuda"), 4, 8, 4,
                              cluster=8)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [1, 8])
def test_the_128k_benchmark_shape_in_a_graph(H):
    """B=6 requests near 128K in a 133120-token table (H=1: the folded scores the engine hands
    over; 8: per KV head), 1472 of ~130K middle tokens: the Triton kernel's choice, replayed in
    a CUDA graph on new scores, as a programmatic dependent launch and not."""
    lens = [131072 + 1, 131072 + 40, 120000, 131072 + 7, 3000, 131072 + 1]
    gen = torch.Generator(device="cuda").manual_seed(7)
    kv_lens = torch.tensor(lens, device="cuda")
    scores = _scores(torch.randn(6, H, 133120, generator=gen, device="cuda").cpu(), lens, 512).cuda()
    table = torch.randperm(6 * 8320, generator=torch.Generator().manual_seed(1)).view(6, 8320).int().cuda()
    for pdl in (True, False):
        want = omnikv_select_triton(scores, kv_lens, 64, 1472, 512, page_table=table, page_size=16)
        got = OC.omnikv_select_cuda(scores, kv_lens, 64, 1472, 512, page_table=table, page_size=16, pdl=pdl)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), pdl
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = OC.omnikv_select_cuda(scores, kv_lens, 64, 1472, 512, page_table=table, page_size=16, pdl=pdl)
        for _ in range(2):
            scores.copy_(_scores(torch.randn(6, H, 133120, generator=gen, device="cuda").cpu(), lens, 512))
            graph.replay()
            want = omnikv_select_triton(scores, kv_lens, 64, 1472, 512, page_table=table, page_size=16)
            assert all(torch.equal(g, w) for g, w in zip(out, want)), pdl


def test_bad_input():
    scores = torch.zeros(2, 1, 64)
    lens = torch.tensor([40, 3])
    with pytest.raises(ValueError, match="scores must be a floating"):
        OC.omnikv_select_cuda(scores[0, 0], lens, 4, 8, 4)
    with pytest.raises(ValueError, match="takes float32 scores, got torch.bfloat16"):
        OC.omnikv_select_cuda(scores.bfloat16(), lens, 4, 8, 4)
    with pytest.raises(ValueError, match="kv_lens must be int32 or int64, got torch.int16"):
        OC.omnikv_select_cuda(scores, lens.short(), 4, 8, 4)
    with pytest.raises(ValueError, match="cluster must be 8 or 16, got 4"):
        OC.omnikv_select_cuda(scores, lens, 4, 8, 4, cluster=4)
    with pytest.raises(ValueError, match="budget"):
        OC.omnikv_select_cuda(scores, lens, 4, -1, 4)
    with pytest.raises(ValueError, match=r"page_table must be \[B=2, P\]"):
        OC.omnikv_select_cuda(scores, lens, 4, 8, 4, page_table=torch.zeros(1, 4, dtype=torch.int32), page_size=16)
    with pytest.raises(ValueError, match="page_table must cover the scores' 64 tokens, got 3 pages of 16"):
        OC.omnikv_select_cuda(scores, lens, 4, 8, 4, page_table=torch.zeros(2, 3, dtype=torch.int32), page_size=16)
    if not torch.cuda.is_available():
        assert not OC.runs_on("cpu") and not OC.takes(scores)
        with pytest.raises(RuntimeError, match="omnikv_select_cuda cannot run: needs a CUDA device"):
            OC.omnikv_select_cuda(scores, lens, 4, 8, 4)


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (no GPU needed: the library loads without one)")
def test_builds_and_reports_its_widest_chunk(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEENGINE_CACHE", str(tmp_path))
    OC.library.cache_clear()
    try:
        assert OC.library().se_omnikv_select_max_chunk() == OC.MAX_CHUNK
    finally:
        OC.library.cache_clear()
    assert list(tmp_path.glob("cuda/*/libse_omnikv_select.so"))


def test_stage_probe_patches_the_source(load_script, tmp_path):
    """scripts/probe_omnikv_pick_stages.py times patched copies of omnikv_select.cu: each patch
    must find its line once (else the probe stops), every stage but `full` differs, each stage
    from the passes on returns past a cluster barrier (its cluster's shared memory was read),
    and one cut copy builds where nvcc is."""
    probe = load_script("probe_omnikv_pick_stages")
    source = (probe.KERNELS / probe.SOURCE).read_text()
    variants = probe.variants()
    assert list(variants) == ["entry", "load", "pass1", "pass2", "pass3", "pass4", "count", "full"]
    assert variants["full"] == source and all(t != source for name, t in variants.items() if name != "full")
    for name in ("pass1", "pass4", "count"):
        stop = variants[name].split("// probe\n", 1)[1].split("return;", 1)[0]
        assert "cluster_arrive();\n    cluster_wait();" in stop, name
    assert "constexpr int PASSES = 2;" in variants["pass2"]
    if find_nvcc() is not None:
        source = patched_copy(probe.KERNELS / probe.SOURCE, {probe.SOURCE: variants["count"]}, tmp_path)
        assert all(u["spill_stores"] == 0 for u in ptxas_usage(source, []).values())
