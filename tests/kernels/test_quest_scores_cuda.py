"""`quest_page_scores_cuda` (Quest's page scores in CUDA) against the torch reference
(`quest_page_scores_ref`) on fresh random bounds, over every KV-head count it takes (1, 2, 4,
8) and groups of 1 to 8 query heads; the decode step's fold against the minmax update (the
same bounds, bit for bit, then the same scores); the tiles wholly past a short request left
unwritten; the same bits with and without PDL, with one, two or 24 CTAs an SM (queued),
and in a CUDA graph; the engine's Quest step with it (eager and replayed tokens equal). On
the CPU: the build (where nvcc is), the errors for bad input (its ctypes table:
test_nvcc_build.py)."""
import json

import pytest
import torch

from sparseengine.kernels import quest_page_scores_ref, quest_page_scores_triton, update_page_minmax_ref
from sparseengine.kernels.quest_scores import quest_page_scores_torch
from sparseengine.kernels import quest_scores_cuda as QS
from sparseengine.kernels.nvcc_build import find_nvcc
from sparseengine.kernels.testing import assert_close, random_paged_kv, randn

from .test_quest import _decode_step, _read, _scored_cache, _with_padding_row
from .test_quest_select import _poison_torch_empty  # noqa: F401 (a fixture the GPU tests use)

_TORCH_EMPTY = torch.empty  # the real one, for the engine test (the fixture above replaces it)

# (Hq, Hkv, d, page_size, kv_lens): every Hkv the kernel takes, groups 1 to 8, pages of 4 to 16,
# a request of one token, tables whose width is no multiple of a tile
GPU_CASES = [
    (32, 8, 128, 16, [300, 17, 1, 129]),
    (8, 2, 128, 4, [9, 7, 300, 64]),
    (8, 8, 128, 16, [200]),
    (24, 8, 128, 16, [500, 33]),
    (64, 8, 128, 16, [100, 260]),
    (4, 1, 128, 16, [70, 2100]),
    (12, 4, 128, 8, [250, 3, 90]),
]


# the reference alone: the other group sizes (2, 5, 6, 7) and a request of no tokens
REFERENCE_CASES = GPU_CASES + [
    (16, 8, 128, 16, [0, 50, 400]),
    (40, 8, 128, 16, [310, 66]),
    (12, 2, 128, 8, [90, 0, 1]),
    (56, 8, 128, 16, [129]),
]


def _id(case):
    hq, hkv, d, ps, lens = case
    return f"hq{hq}-hkv{hkv}-ps{ps}-b{len(lens)}"


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (no GPU needed: the library loads without one)")
def test_builds_and_reports_its_head_dim(monkeypatch, tmp_path):
    """The default build and the one asking L2 for 256 B around each load of the bounds
    (two libraries, one directory a build)."""
    monkeypatch.setenv("SPARSEENGINE_CACHE", str(tmp_path))
    QS._library.cache_clear()
    try:
        for prefetch in (0, 256):
            assert QS.library(prefetch).se_quest_scores_head_dim() == QS.HEAD_DIM
    finally:
        QS._library.cache_clear()
    assert len(list(tmp_path.glob("cuda/*/libse_quest_scores.so"))) == 2


def test_bad_build(monkeypatch):
    for prefetch in (32, True, "256"):
        with pytest.raises(ValueError, match=r"l2_prefetch must be one of \(0, 64, 128, 256\), got"):
            QS.library(prefetch)
    monkeypatch.setattr(QS, "BUILD_L2_PREFETCH", 100)  # the module's default, checked the same way
    with pytest.raises(ValueError, match="l2_prefetch must be one of .*, got 100"):
        QS.library()


def test_shapes_it_takes():
    bf16 = torch.bfloat16
    assert QS.shape_reason(32, 8, 128, bf16) is None and QS.shape_reason(4, 1, 128, bf16) is None
    assert QS.shape_reason(32, 8, 64, bf16) == "takes head_dim 128, got 64"
    assert QS.shape_reason(32, 8, 128, torch.float32) == "takes bf16 bounds and queries, got torch.float32"
    for hq, hkv in ((48, 16), (27, 3), (72, 8), (6, 4)):  # Hkv not dividing 8, a group of 9, a ragged group
        assert QS.shape_reason(hq, hkv, 128, bf16).startswith("takes Hkv dividing 8 and 1 to 8"), (hq, hkv)


def test_bad_input():
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    hi = torch.zeros(10, 2, 128, dtype=torch.bfloat16)
    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    args = (q, hi, hi.clone(), table, lens, 4)
    call = QS.quest_page_scores_cuda
    with pytest.raises(ValueError, match="takes head_dim 128, got 64"):
        call(q[..., :64], hi[..., :64], hi[..., :64], table, lens, 4)
    with pytest.raises(ValueError, match="takes bf16 bounds and queries, got torch.float32"):
        call(q, hi.float(), hi.float(), table, lens, 4)
    with pytest.raises(ValueError, match=r"kmax and kmin must be contiguous \(10, 2, 128\)"):
        call(q, hi, hi[:5], table, lens, 4)
    with pytest.raises(ValueError, match=r"page_table must be an int32 \[B=2, P\] tensor"):
        call(q, hi, hi, table.long(), lens, 4)
    with pytest.raises(ValueError, match=r"kv_lens must be an int32 or int64 \[B=2\] tensor"):
        call(q, hi, hi, table, lens.short(), 4)
    with pytest.raises(ValueError, match="page_size must be an int >= 1, got 0"):
        call(*args[:5], 0)
    with pytest.raises(ValueError, match="k_cache and new_slots go together"):
        call(*args, k_cache=torch.zeros(10, 4, 2, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"k_cache must be \[10, page_size=4, 2, 128\], got \(9, 4, 2, 128\)"):
        call(*args, k_cache=torch.zeros(9, 4, 2, 128, dtype=torch.bfloat16), new_slots=lens)
    with pytest.raises(ValueError, match=r"k_cache must be \[10, page_size=4, 2, 128\], got \(10, 8, 2, 128\)"):
        call(*args, k_cache=torch.zeros(10, 8, 2, 128, dtype=torch.bfloat16), new_slots=lens)
    with pytest.raises(ValueError, match="pdl=True needs the fold"):
        call(*args, pdl=True)
    for ctas in (0, 65, 2.0):
        with pytest.raises(ValueError, match=f"ctas_per_sm must be an int from 1 to 64, got {ctas}"):
            call(*args, ctas_per_sm=ctas)
    with pytest.raises(RuntimeError, match="cannot run: needs a CUDA device, got cpu"):
        call(*args)
    assert not QS.takes(q, hi)


# ---------------------------------------------------------------------------- on the GPU


def _cuda_cache(case, gen):
    hq, hkv, d, ps, lens = case
    kv, args = _scored_cache((hq, hkv, d, ps, lens), gen, "cuda")
    return kv, tuple(a.bfloat16() if a.is_floating_point() else a for a in args[:3]) + args[3:]


@pytest.mark.gpu
@pytest.mark.usefixtures("_poison_torch_empty")
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=_id)
def test_equals_the_reference(case, gen):
    _, args = _cuda_cache(case, gen)
    ref = quest_page_scores_ref(*args)
    for lens_dtype in (torch.int32, torch.int64):
        got = QS.quest_page_scores_cuda(*args[:4], args[4].to(lens_dtype), args[5])
        assert_close(_read(got, args[4], args[5]), ref, 1e-3, str(lens_dtype))


@pytest.mark.gpu
@pytest.mark.usefixtures("_poison_torch_empty")
def test_tiles_past_a_short_request_stay_unwritten(gen):
    """A 5-page request in a 125-page table: its 16-page tiles past the first are not
    written (the NaN poison stays); in the first, its pages past the fifth read -inf."""
    _, args = _cuda_cache((32, 8, 128, 4, [500, 20]), gen)
    got = QS.quest_page_scores_cuda(*args)
    assert torch.isnan(got[1, :, 16:]).all() and not torch.isnan(got[1, :, :16]).any()
    assert torch.isneginf(got[1, :, 5:16]).all() and not torch.isnan(got[0]).any()
    assert_close(_read(got, args[4], 4), quest_page_scores_ref(*args), 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_id)
def test_fold_the_step_keys(case, gen):
    """The step's keys folded into their pages' bounds (offset 0 starts a page afresh), bit
    for bit as the minmax update makes them, then scored; a padding row (slot -1) folds
    nothing; slots as int64 (the engine's) and int32."""
    hq, hkv, d, ps, lens = case
    for slot_dtype in (torch.int64, torch.int32):
        kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=torch.bfloat16, device="cuda")
        (hi, lo), (want_hi, want_lo), last = _decode_step(kv, gen, "cuda")
        table, kv_lens, slots = _with_padding_row(kv, last)
        q = randn(len(lens) + 1, hq, d, generator=gen, dtype=torch.bfloat16, device="cuda")
        want = quest_page_scores_ref(q, want_hi, want_lo, table, kv_lens, ps)
        got = QS.quest_page_scores_cuda(q, hi, lo, table, kv_lens, ps, k_cache=kv.k_cache,
                                        new_slots=slots.to(slot_dtype))
        torch.testing.assert_close(hi, want_hi, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(lo, want_lo, rtol=0, atol=0, equal_nan=True)
        assert_close(_read(got, kv_lens, ps)[:-1], want[:-1], 1e-3, str(slot_dtype))


def decode_step_128k(gen):
    """A decode step's scoring at the 128K benchmark's shape (6 requests, 8320-page tables
    scattered over a pool, 32 query / 8 KV heads, pages of 16; request 1's last token at
    offset 10 of its last page): `(q, kmax, kmin, table, kv_lens, fold, (kmax, kmin) as the
    minmax update makes them with the step's keys)`, `fold` the step's `k_cache` and
    `new_slots`."""
    B, P, hq, hkv, d, ps, n = 6, 8320, 32, 8, 128, 16, 131072
    pool = B * P + 8
    cuda_gen = torch.Generator("cuda").manual_seed(int(torch.randint(2 ** 31, (1,), generator=gen)))
    table = torch.randperm(pool, generator=gen)[: B * P].view(B, P).int().cuda()
    lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    lens[1] = n - 5
    slots = (table[torch.arange(B, device="cuda"), (lens.long() - 1) // ps].long() * ps + (lens.long() - 1) % ps)
    k_cache = torch.zeros(pool, ps, hkv, d, dtype=torch.bfloat16, device="cuda")  # the step's keys: all the fold reads
    k_cache.view(-1, hkv, d)[slots] = torch.randn(B, hkv, d, generator=cuda_gen, device="cuda").bfloat16()
    hi = torch.randn(pool, hkv, d, generator=cuda_gen, device="cuda").bfloat16()
    lo = hi - torch.rand(pool, hkv, d, generator=cuda_gen, device="cuda").bfloat16()
    q = randn(B, hq, d, generator=gen, dtype=torch.bfloat16, device="cuda")
    want_hi, want_lo = hi.clone(), lo.clone()
    update_page_minmax_ref(k_cache, slots, want_hi, want_lo)  # the fold, as the update makes it
    return q, hi, lo, table, lens, {"k_cache": k_cache, "new_slots": slots}, (want_hi, want_lo)


@pytest.mark.gpu
def test_launches_agree_bit_for_bit_and_replay_in_a_graph(gen):
    """At the 128K benchmark's shape (6 requests, 8320-page tables, 8 KV heads of 32 query
    heads), a decode step's fold and scores: the same bits with and without PDL and with
    one, two or 24 CTAs an SM (24: a CTA an item, most queued), from the default build (L2
    asked for 256 B around each load) and the plain one, in a CUDA graph too, and the Triton
    kernel's within rounding (the sums run in another order) with the same folded bounds."""
    q, hi, lo, table, lens, fold, (want_hi, want_lo) = decode_step_128k(gen)
    k_cache, slots, ps = fold["k_cache"], fold["new_slots"], 16
    runs = {}
    for pdl in (True, False):
        for ctas in (1, 2, 24):  # 24: a CTA an item, most of them queued
            bounds = (hi.clone(), lo.clone())
            # the clones finished first: a PDL launch may load the bounds before the kernel just before it (here the
            # clone that writes them; in the engine the qkv linear, which does not) has finished
            torch.cuda.synchronize()
            runs[pdl, ctas] = QS.quest_page_scores_cuda(q, *bounds, table, lens, ps, k_cache=k_cache, new_slots=slots,
                                                        pdl=pdl, ctas_per_sm=ctas)
            assert torch.equal(bounds[0], want_hi) and torch.equal(bounds[1], want_lo), (pdl, ctas)
    bounds = (hi.clone(), lo.clone())
    torch.cuda.synchronize()
    runs["l2_0"] = QS.quest_page_scores_cuda(q, *bounds, table, lens, ps, k_cache=k_cache, new_slots=slots,
                                             l2_prefetch=0)  # the plain build (the default asks L2 for 256 B)
    assert torch.equal(bounds[0], want_hi) and torch.equal(bounds[1], want_lo)
    first = runs[True, 2]
    for key, got in runs.items():
        assert torch.equal(_read(got, lens, ps), _read(first, lens, ps)), key
    triton = quest_page_scores_triton(q, want_hi.clone(), want_lo.clone(), table, lens, ps)
    assert_close(_read(first, lens, ps), _read(triton, lens, ps), 1e-3)
    bounds = (hi.clone(), lo.clone())
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()  # the clones above done (made on the default stream) before the PDL launches below
    with torch.cuda.stream(stream):
        QS.quest_page_scores_cuda(q, *bounds, table, lens, ps, k_cache=k_cache, new_slots=slots)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = QS.quest_page_scores_cuda(q, *bounds, table, lens, ps, k_cache=k_cache, new_slots=slots)
    bounds[0].copy_(hi), bounds[1].copy_(lo)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_read(out, lens, ps), _read(first, lens, ps))
    assert torch.equal(bounds[0], want_hi) and torch.equal(bounds[1], want_lo)


@pytest.mark.gpu
def test_many_ragged_requests(gen):
    """40 requests of 1 to 32000 tokens in a 2000-page table (5000 work items, ~19 a CTA):
    each CTA's loop over items, its query reused across items of one request and reloaded
    at the next, the tiles past a short request skipped; the step's keys folded at every
    offset (0 included)."""
    B, P, hq, hkv, d, ps = 40, 2000, 32, 8, 128, 16
    cuda_gen = torch.Generator("cuda").manual_seed(int(torch.randint(2 ** 31, (1,), generator=gen)))
    lens = torch.randint(1, P * ps + 1, (B,), generator=gen)
    lens[:4] = torch.tensor([1, 16, 17, P * ps])  # one token, a page ending at offset 15, one at offset 0, full
    pool = B * P
    table = torch.randperm(pool, generator=gen)[: B * P].view(B, P).int().cuda()
    lens = lens.int().cuda()
    last = (lens.long() - 1)
    slots = table[torch.arange(B, device="cuda"), last // ps].long() * ps + last % ps
    k_cache = torch.zeros(pool, ps, hkv, d, dtype=torch.bfloat16, device="cuda")
    k_cache.view(-1, hkv, d)[slots] = torch.randn(B, hkv, d, generator=cuda_gen, device="cuda").bfloat16()
    hi = torch.randn(pool, hkv, d, generator=cuda_gen, device="cuda").bfloat16()
    lo = hi - torch.rand(pool, hkv, d, generator=cuda_gen, device="cuda").bfloat16()
    q = torch.randn(B, hq, d, generator=cuda_gen, device="cuda").bfloat16()
    want_hi, want_lo = hi.clone(), lo.clone()
    update_page_minmax_ref(k_cache, slots, want_hi, want_lo)
    got = QS.quest_page_scores_cuda(q, hi, lo, table, lens, ps, k_cache=k_cache, new_slots=slots)
    assert torch.equal(hi, want_hi) and torch.equal(lo, want_lo)
    want = quest_page_scores_torch(q, want_hi, want_lo, table, lens, ps)
    assert_close(_read(got, lens, ps), want, 1e-3)


def quest_model_dir(tmp_path):
    """A model both Quest CUDA kernels take (head dim 128, 16 query / 8 KV heads, 3 layers;
    dummy weights load from its config)."""
    from sparseengine.models.loader import SHAPES_DIR

    cfg = json.loads((SHAPES_DIR / "tiny-llama.json").read_text())
    cfg.update(hidden_size=2048, intermediate_size=4096, num_hidden_layers=3, num_attention_heads=16,
               num_key_value_heads=8, head_dim=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def quest_engine_tokens(model_dir, eager, check_kernels):
    """Four prompts' 24 greedy tokens from Quest (bf16, total 112) on the GPU, eager or with
    decode graphs; `check_kernels` sees the method's kernel record first."""
    from sparseengine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (700, 260, 513, 390)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(model_dir, load_format="dummy", device="cuda", dtype="bfloat16", sparse_method="quest",
             sink_tokens=16, budget=64, recent_tokens=32, num_kv_pages=512, enforce_eager=eager) as llm:
        check_kernels(llm.method.kernels(llm.device, llm.provider))
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        assert (llm.runner.graph_steps > 0) != eager
    return tokens


@pytest.mark.gpu
def test_in_the_engine(tmp_path, monkeypatch):
    """A model the kernel takes (`quest_model_dir`): with `ENGINE` on, Quest's decode step
    scores with it (each call outside a graph capture checked against the reference on the
    bounds the update would make: the fold's), the records say so, and its tokens are the
    Triton scores', eager and in decode graphs alike. (Eager against graph tokens is no test
    in bf16: with the Triton scores as well, one of the four requests' tokens differ between
    the two paths, H200 s49-4.)"""
    from sparseengine.kernels import quest_select_cuda

    # the engine allocates with the real torch.empty, not the module's poisoned one (before the fixture warmed
    # torch's cache of device factories, the poisoned one built the model's linears on the CPU: s49-2)
    monkeypatch.setattr(torch, "empty", _TORCH_EMPTY)
    model = quest_model_dir(tmp_path)
    assert quest_select_cuda.takes("cuda", 64)  # the scores run in the CUDA choice's branch
    real, checked = QS.quest_page_scores_cuda, []

    def checking(q, kmax, kmin, table, lens, ps, **fold):
        if torch.cuda.is_current_stream_capturing():
            return real(q, kmax, kmin, table, lens, ps, **fold)
        hi, lo = kmax.clone(), kmin.clone()
        if fold.get("k_cache") is not None:
            update_page_minmax_ref(fold["k_cache"], fold["new_slots"], hi, lo)
        got = real(q, kmax, kmin, table, lens, ps, **fold)
        assert torch.equal(kmax, hi) and torch.equal(kmin, lo)
        assert_close(_read(got, lens, ps), quest_page_scores_ref(q, hi, lo, table, lens, ps), 1e-3)
        checked.append(bool(fold))
        return got

    monkeypatch.setattr(QS, "quest_page_scores_cuda", checking)
    tokens = {}
    for on in (False, True):
        monkeypatch.setattr(QS, "ENGINE", on)
        for eager in (True, False):
            checked.clear()

            def check_kernels(kernels):
                assert kernels["quest_scores"] == ("cuda" if on else "triton"), kernels

            tokens[on, eager] = quest_engine_tokens(model, eager, check_kernels)
            assert any(checked) == on, (on, eager, checked)  # decode steps scored here, the step's keys folded in
            if on and eager:
                assert len(checked) >= 20, checked  # every eager decode step's sparse layer
    assert tokens[True, True] == tokens[False, True] and tokens[True, False] == tokens[False, False]
