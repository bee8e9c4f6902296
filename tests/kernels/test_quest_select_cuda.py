"""`quest_select_pages_cuda` (Quest's page choice in CUDA) against the torch path
(`select_pages_batched`) on distinct scores and against the per-request definition
(`quest_select_pages`, ties to the earlier page) on scores full of ties; through its rank
path (at most 512 candidates, one or two a thread) and its block search (more: many equal scores); equal to the
Triton kernel at the 128K benchmark's shape, in a CUDA graph and as a programmatic
dependent launch; rows read as float4 where their storage holds P rounded up to 4 (the
engine's 8321-page rows as the CUDA scores store them). On the CPU: the errors for bad input,
which rows are read whole (`whole_rows`), the build (where nvcc is) and the stage probe's patches; its ctypes table:
test_nvcc_build.py. The engine with it: tests/methods/test_graph_vs_eager_gpu.py."""
import struct

import pytest
import torch

from sparseengine.kernels import quest_select_cuda as QC
from sparseengine.kernels import quest_select_pages_triton
from sparseengine.kernels.nvcc_build import find_nvcc
from sparseengine.methods.quest import select_pages_batched
from sparseengine.methods.selection import quest_select_pages

from .test_quest_select import CASES, _case_id, _poison_torch_empty, _scores  # noqa: F401 (the fixture)


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (no GPU needed: the library loads without one)")
def test_builds_and_reports_its_widest_row(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEENGINE_CACHE", str(tmp_path))
    QC.library.cache_clear()
    try:
        assert QC.library().se_quest_select_max_pages() == QC.max_pages()
    finally:
        QC.library.cache_clear()
    assert list(tmp_path.glob("cuda/*/libse_quest_select.so"))


def _key(f: float) -> int:  # qsel::key_of by the float's bits, one value at a time
    (bits,) = struct.unpack("<I", struct.pack("<f", 0.0 if f == 0 else f))
    return bits ^ 0xFFFFFFFF if bits >> 31 else bits | 1 << 31


def test_stage_probe_patches_the_header(load_script):
    """scripts/probe_quest_select_cuda_stages.py times patched copies of quest_select.cuh: each
    patch must find its line once (else the probe stops), and every variant but `full` differs."""
    probe = load_script("probe_quest_select_cuda_stages")
    header = (probe.KERNELS / probe.HEADER).read_text()
    variants = probe.variants()
    assert set(probe.STAGES) < set(variants) and variants["full"] == header
    assert all(text != header for name, text in variants.items() if name != "full")


@pytest.mark.parametrize("bits", [16, 24, 32])
def test_stage_probe_counts_the_kernels_candidates(bits, gen, load_script):
    """The probe's candidate counts are the kernel's: L the m-th largest of the 256 threads' 36-key maxima (0 off
    the middle pages), settled to its top `bits` bits; the candidates the middle keys >= L. On scores that share
    their top bits (1000 + small noise) 16 bits take many more than 32."""
    probe = load_script("probe_quest_select_cuda_stages")
    n, sink, recent, m = 131072 - 4096, 4, 512, 92
    scores = torch.cat([1000 + torch.rand(1, 1, 7936, generator=gen), torch.randn(1, 1, 7936, generator=gen)], 1)
    got = probe.candidates(scores, n, sink, recent, m, bits=bits)
    first = (n - recent) // 16
    for r in range(2):
        keys = [_key(f) if sink <= p < first else 0 for p, f in enumerate(scores[0, r].tolist())]
        keys += [0] * (256 * 36 - len(keys))
        L = sorted((max(keys[t * 36:t * 36 + 36]) for t in range(256)), reverse=True)[m - 1]
        L &= 0xFFFFFFFF ^ ((1 << (32 - bits)) - 1)
        assert int(got[0, r]) == sum(k != 0 and k >= L for k in keys)
    if bits == 16:
        assert int(got[0, 0]) > 4 * int(probe.candidates(scores, n, sink, recent, m)[0, 0])


def test_bad_input():
    lens = torch.tensor([40], dtype=torch.int32)
    scores = torch.zeros(1, 2, 10)
    with pytest.raises(ValueError, match=r"scores must be a floating \[B, Hkv, P\] tensor, got \(2, 10\)"):
        QC.quest_select_pages_cuda(scores[0], lens, 4, 4, 4, 8)
    with pytest.raises(ValueError, match="takes float32 scores, got torch.bfloat16"):
        QC.quest_select_pages_cuda(scores.bfloat16(), lens, 4, 4, 4, 8)
    with pytest.raises(ValueError, match=r"kv_lens must be an integer \[B=1\] tensor"):
        QC.quest_select_pages_cuda(scores, torch.tensor([40, 3]), 4, 4, 4, 8)
    with pytest.raises(ValueError, match="kv_lens must be int32 or int64, got torch.int16"):
        QC.quest_select_pages_cuda(scores, lens.short(), 4, 4, 4, 8)
    with pytest.raises(ValueError, match="page_size must be an integer >= 1, got 0"):
        QC.quest_select_pages_cuda(scores, lens, 0, 4, 4, 8)
    with pytest.raises(ValueError, match=f"takes 1 to {QC.max_pages()} pages a row, got P={QC.max_pages() + 1}"):
        QC.quest_select_pages_cuda(torch.zeros(1, 1, QC.max_pages() + 1), lens, 4, 4, 4, 8)
    with pytest.raises(RuntimeError, match="cannot run: needs a CUDA device, got cpu"):
        QC.quest_select_pages_cuda(scores, lens, 4, 4, 4, 8)
    assert not QC.takes("cpu", 10)


# ---------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_equals_torch_path_on_distinct_scores(case, gen):
    lens, hkv, P, ps, sink, budget, recent, _ = case
    scores = _scores(torch.randn(len(lens), hkv, P, generator=gen), lens, ps).cuda()
    for dtype in (torch.int32, torch.int64):
        args = (scores, torch.tensor(lens, dtype=dtype, device="cuda"), ps, sink, recent, budget)
        pages, counts = QC.quest_select_pages_cuda(*args)
        want_pages, want_counts = select_pages_batched(*args)
        assert pages.dtype == torch.int64 and counts.dtype == torch.int32
        assert torch.equal(counts, want_counts) and torch.equal(pages, want_pages), dtype


def _check_definition(pages, counts, scores, lens, ps, sink, recent, budget, where=""):
    for b, n in enumerate(lens):
        want = quest_select_pages(scores[b, :, : -(-n // ps)].cpu(), n, ps, sink, recent, budget)
        for h in range(scores.shape[1]):
            count = int(counts[b, h])
            assert count == want.shape[1], (where, b, h)
            assert pages[b, h, :count].tolist() == want[h].tolist(), (where, b, h)
            assert (pages[b, h, count:] == -1).all(), (where, b, h)


@pytest.mark.gpu
def test_ties_go_to_the_earlier_page(gen):
    """Scores from a handful of values (with -inf, +inf and both zeros): each row is the
    definition's choice. Few distinct values put hundreds of pages at the threshold, so
    both the rank path and the block search run."""
    lens, hkv, P, ps, sink, budget, recent = [16 * 90 + 3, 300, 1000, 40, 0], 3, 95, 16, 20, 160, 30
    palette = torch.tensor([-1.5, -0.0, 0.0, 0.25, 0.25, 2.0, float("-inf"), float("inf")])
    values = palette[torch.randint(0, 6, (len(lens), hkv, P), generator=gen)]
    values[0, 0, 30:40] = float("-inf")
    values[0, 1, 5:8] = float("inf")
    values[1, 2] = 0.5
    scores = _scores(values, lens, ps).cuda()
    kv_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    _check_definition(*QC.quest_select_pages_cuda(scores, kv_lens, ps, sink, recent, budget), scores, lens, ps, sink,
                      recent, budget)
    # 128K rows: 8150 middle pages from 3 values (thousands of candidates: the block path), and from 2000
    lens, P = [131072, 120000, 50000], 8320
    for values in (3, 2000):
        scores = _scores(torch.randint(0, values, (len(lens), 4, P), generator=gen).float(), lens, ps).cuda()
        args = (scores, torch.tensor(lens, dtype=torch.int32, device="cuda"), ps, 64, 512, 1472)
        _check_definition(*QC.quest_select_pages_cuda(*args), scores, lens, ps, 64, 512, 1472, where=values)


@pytest.mark.gpu
@pytest.mark.parametrize("vec", [True, False])
@pytest.mark.parametrize("P", [1, 17, 1024, 1025, 4096 + 7, 9216, 12288, 16384])
def test_every_build_width(P, vec, gen, monkeypatch):
    """Each build (keys a thread) at its widest and just past the one below: rows as long as
    the table and shorter ones, against the torch path; rows of a multiple of 4 pages read
    as float4 through shared memory (`VEC`: past 48 KB of it at 12288 pages and more) or not."""
    monkeypatch.setattr(QC, "VEC", vec)
    ps, sink, budget, recent = 16, 32, 256, 64
    lens = [P * ps, max(1, P * ps - 100), (P * ps) // 3 + 1, 5]
    scores = _scores(torch.randn(len(lens), 2, P, generator=gen), lens, ps).cuda()
    args = (scores, torch.tensor(lens, dtype=torch.int32, device="cuda"), ps, sink, recent, budget)
    for g, w in zip(QC.quest_select_pages_cuda(*args), select_pages_batched(*args)):
        assert torch.equal(g, w)


def test_whole_rows():
    """Which scores the choice reads as float4: rows 16 bytes apart and aligned whose storage
    holds P rounded up to 4 floats: the CUDA scores' buffers at every width (the engine's
    8321-page table at the 128K benchmark's max_model_len, 133120 tokens plus one, among
    them), not a plain tensor of 8321 pages."""
    from sparseengine.kernels.quest_scores_cuda import scores_buffer

    for P in (1, 2, 3, 4, 5, 8320, 8321, 8322, 8323):
        assert QC.whole_rows(scores_buffer(6, 8, P, "cpu")), P
    assert QC.whole_rows(torch.empty(6, 8, 8320))
    assert not QC.whole_rows(torch.empty(6, 8, 8321))  # rows 8321 floats apart
    assert not QC.whole_rows(torch.empty(2 * 8 * 8324 + 2)[2:].view(2, 8, 8324)[..., :8321])  # 8 bytes off
    assert not QC.whole_rows(torch.empty(2, 8, 8324)[..., 1:8322])  # each row 4 bytes off
    assert not QC.whole_rows(torch.empty(1, 1, 5))  # its last float4 would pass the storage
    assert not QC.whole_rows(torch.empty(2, 8, 8324)[..., ::2])  # pages not contiguous


@pytest.mark.gpu
def test_strided_scores(gen):
    """Scores as a slice of a wider table (row strides that are not P), read both ways: score
    by score (rows 262 floats apart), as float4 (rows 260 apart, 210 pages read as 212, and
    208 pages)."""
    lens, ps = [16 * 200, 16 * 150 + 3], 16
    for width, P, vec in ((262, 210, False), (260, 210, True), (260, 208, True)):
        wide = _scores(torch.randn(2, 3, width, generator=gen), lens, ps).cuda()
        assert QC.whole_rows(wide[..., :P]) == vec
        args = (wide[..., :P], torch.tensor(lens, device="cuda"), ps, 16, 48, 320)
        for g, w in zip(QC.quest_select_pages_cuda(*args), select_pages_batched(*args)):
            assert torch.equal(g, w), (width, P)


@pytest.mark.gpu
def test_the_engine_width_read_as_float4(gen):
    """The engine's 128K table (8321 pages: max_model_len 133120 plus a token) stored as the
    CUDA scores store it, rows of 8324: read as float4, the torch path's choice and the
    Triton kernel's."""
    lens, hkv, P, ps = [131072, 131000, 70000, 4097, 2100, 0], 8, 8321, 16
    scores = _scores(torch.randn(len(lens), hkv, 8324, generator=gen), lens, ps).cuda()[..., :P]
    assert QC.whole_rows(scores)
    args = (scores, torch.tensor(lens, dtype=torch.int32, device="cuda"), ps, 64, 512, 1472)
    got = QC.quest_select_pages_cuda(*args)
    for want in (select_pages_batched(*args), quest_select_pages_triton(scores.contiguous(), *args[1:])):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_128k_batch6_equals_triton_in_a_cuda_graph(pdl, gen):
    """The benchmark's shape (B=6, Hkv=8, an 8320-page table, total 2048): captured after the
    page scores' stand-in (a copy) and replayed on fresh scores, plain and as a programmatic
    dependent launch: the Triton kernel's pages and counts, and the torch path's."""
    lens, hkv, P, ps, sink, budget, recent = [131072, 131000, 70000, 4097, 2100, 0], 8, 8320, 16, 64, 1472, 512
    kv_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    source = torch.empty(len(lens), hkv, P, device="cuda")
    scores = torch.empty_like(source)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scores.copy_(source)
        pages, counts = QC.quest_select_pages_cuda(scores, kv_lens, ps, sink, recent, budget, pdl=pdl)
    for fresh in (torch.randn(len(lens), hkv, P, generator=gen),
                  torch.randn(len(lens), hkv, P, generator=gen).round(decimals=1)):  # many ties
        source.copy_(_scores(fresh, lens, ps))
        pages.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        args = (scores, kv_lens, ps, sink, recent, budget)
        want_pages, want_counts = quest_select_pages_triton(*args)
        assert torch.equal(counts, want_counts) and torch.equal(pages, want_pages)
    _check_definition(pages, counts, scores, lens, ps, sink, recent, budget)


def _tied_candidates(n_cand: int, P: int = 8320, n: int = 131072, ps: int = 16, sink: int = 64, recent: int = 512,
                     budget: int = 1472) -> tuple[torch.Tensor, list[int]]:
    """One row whose middle pages score -1 but `n_cand` of them, spread evenly, which score 1:
    the m-th largest of the threads' maxima is 1, so exactly those pages are the candidates,
    and the choice is their earliest m (ties to the earlier page). -> (scores [1, 1, P], the
    pages chosen)."""
    first, end = -(-sink // ps), (n - recent) // ps
    scores = torch.full((1, 1, P), -1.0)
    ones = torch.linspace(first, end - 1, n_cand).round().long().unique()
    assert len(ones) == n_cand
    scores[0, 0, ones] = 1.0
    return scores, ones[: budget // ps].tolist()


def test_tied_candidates_construction():
    """The rows below: the Triton kernel (the interpreter on a CPU) takes the earliest m ones."""
    for n_cand in (93, 300):
        scores, want = _tied_candidates(n_cand)
        pages, counts = quest_select_pages_triton(scores, torch.tensor([131072]), 16, 64, 512, 1472)
        assert pages[0, 0, 4:4 + len(want)].tolist() == want


@pytest.mark.gpu
@pytest.mark.parametrize("n_cand", [93, 128, 129, 256, 257, 512, 513, 2000])
def test_candidate_counts_across_the_rank_and_block_paths(n_cand):
    """Exactly `n_cand` candidates tied at the threshold (the rank path's edges, one and two a
    thread: 256, 512; past 512 the block search): the earliest m, as the definition and the
    Triton kernel take them."""
    scores, want = _tied_candidates(n_cand)
    args = (scores.cuda(), torch.tensor([131072], dtype=torch.int32, device="cuda"), 16, 64, 512, 1472)
    pages, counts = QC.quest_select_pages_cuda(*args)
    assert pages[0, 0, 4:4 + len(want)].tolist() == want
    for g, w in zip((pages, counts), quest_select_pages_triton(*args)):
        assert torch.equal(g, w)
