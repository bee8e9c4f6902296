import pytest
import torch
import torch.nn.functional as F

from sparseengine.kernels import paged_decode_ref, paged_decode_triton
from sparseengine.kernels import balanced_plan
from sparseengine.kernels.paged_decode import MODE_DENSE, split_k_decode
from sparseengine.kernels.balanced_plan import balanced_chunks
from sparseengine.kernels.split_plan import min_chunk_for, split_plan
from sparseengine.kernels.testing import CASES, assert_close, case_id, random_paged_kv, randn


def _inputs(case, gen, device, dtype=torch.float32):
    hq, hkv, d, ps, lens = case
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=dtype, device=device)
    q = randn(len(lens), hq, d, generator=gen, dtype=dtype, device=device)
    return q, kv


def dense_decode(q, kv):
    """Plainest oracle: SDPA over each request's K/V gathered through flat slots."""
    B, hq, d = q.shape
    g = hq // kv.k_cache.shape[2]
    out = []
    for b in range(B):
        k, v = kv.dense(b)
        k, v = k.float().repeat_interleave(g, 1).transpose(0, 1), v.float().repeat_interleave(g, 1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[b].float()[:, None], k, v)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ref_matches_dense(case, gen, device):
    q, kv = _inputs(case, gen, device)
    out, lse = paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, return_lse=True)
    assert_close(out, dense_decode(q, kv), 1e-5, "out")
    g, d = q.shape[1] // kv.k_cache.shape[2], q.shape[2]
    dense_lse = torch.stack([
        torch.logsumexp(torch.einsum("hd,nhd->hn", q[b], kv.dense(b)[0].repeat_interleave(g, 1)) / d**0.5, -1)
        for b in range(q.shape[0])])
    assert_close(lse, dense_lse, 1e-5, "lse")


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("kv_chunk", [16, None])
def test_triton_matches_ref(case, kv_chunk, gen, device):
    q, kv = _inputs(case, gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    out_ref, lse_ref = paged_decode_ref(*args, return_lse=True)
    out, lse = paged_decode_triton(*args, return_lse=True, kv_chunk=kv_chunk)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(lse, lse_ref, 1e-4, "lse")
    assert_close(paged_decode_triton(*args, scale=0.3, kv_chunk=kv_chunk), paged_decode_ref(*args, scale=0.3))


def test_empty_request_and_strided_q(gen, device):
    q, kv = _inputs((8, 2, 32, 4, [0, 21, 3]), gen, device)
    q = torch.cat([q, q], dim=-1)[..., :32]  # non-contiguous rows
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    out, lse = paged_decode_triton(*args, return_lse=True, kv_chunk=16)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    out_ref, lse_ref = paged_decode_ref(*args, return_lse=True)
    assert_close(out, out_ref)
    assert_close(lse, lse_ref)


# GQA 4, capacity 76 tokens: kv_chunk 16 gives 5 splits, of which request 1 (5 tokens) fills
# one and request 2 none; kv_chunk 128 gives one split (the kernel writes the output itself).
MERGE_CASE = (8, 2, 32, 4, [70, 5, 0, 33])


def _split_k(q, kv, kv_chunk, fused_combine):
    return split_k_decode(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, mode=MODE_DENSE,
                          capacity=kv.page_table.shape[1] * kv.page_size, return_lse=True, kv_chunk=kv_chunk,
                          fused_combine=fused_combine)


def test_callers_counters(gen, device, monkeypatch):
    """A launch that merges in the split kernel takes its arrival counters from the caller
    (the device's shared buffer is never asked for) and leaves them at zero; bad counters
    are refused by name."""
    from sparseengine.kernels import _common

    q, kv = _inputs(MERGE_CASE, gen, device)
    want = _split_k(q, kv, 16, fused_combine=True)

    def shared(*args):
        raise AssertionError("the shared counters were used")

    monkeypatch.setattr(_common, "zeroed_counters", shared)
    rows = q.shape[0] * kv.k_cache.shape[2]
    counters = torch.zeros(rows, dtype=torch.int32, device=device)
    for _ in range(2):  # the second launch finds them at zero again
        got = split_k_decode(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, mode=MODE_DENSE,
                             capacity=kv.page_table.shape[1] * kv.page_size, return_lse=True, kv_chunk=16,
                             fused_combine=True, counters=counters)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert int(counters.abs().sum()) == 0
    for bad in (torch.zeros(rows, dtype=torch.int64, device=device), torch.zeros(rows - 1, dtype=torch.int32,
                                                                                  device=device), "zeros"):
        with pytest.raises(ValueError, match=f"counters must be a contiguous int32 vector of at least B \\* Hkv = "
                                             f"{rows}"):
            split_k_decode(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, mode=MODE_DENSE,
                           capacity=kv.page_table.shape[1] * kv.page_size, kv_chunk=16, fused_combine=True,
                           counters=bad)


@pytest.mark.parametrize("kv_chunk", [16, 128], ids=["5-splits", "1-split"])
def test_fused_combine_matches_ref_and_two_kernel_path(kv_chunk, gen, device):
    q, kv = _inputs(MERGE_CASE, gen, device)
    out_ref, lse_ref = paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, return_lse=True)
    out, lse = _split_k(q, kv, kv_chunk, fused_combine=True)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(lse, lse_ref, 1e-4, "lse")
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()
    out_2k, lse_2k = _split_k(q, kv, kv_chunk, fused_combine=False)
    assert_close(out_2k, out_ref, 1e-4, "two-kernel out")
    assert_close(out, out_2k, 1e-6, "fused vs two-kernel out")
    assert_close(lse, lse_2k, 1e-6, "fused vs two-kernel lse")


def test_fused_combine_resets_its_counters(gen, device):
    """The last program zeros its row's counter: a second launch (and one over more rows,
    reusing the counters) merges again instead of leaving the poisoned output."""
    q, kv = _inputs(MERGE_CASE, gen, device)
    first = _split_k(q, kv, 16, fused_combine=True)
    second = _split_k(q, kv, 16, fused_combine=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    q2, kv2 = _inputs((8, 4, 32, 4, [9, 40, 64]), gen, device)
    out, lse = _split_k(q2, kv2, 16, fused_combine=True)
    out_ref, lse_ref = paged_decode_ref(q2, kv2.k_cache, kv2.v_cache, kv2.page_table, kv2.kv_lens, return_lse=True)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(lse, lse_ref, 1e-4, "lse")


@pytest.mark.parametrize("row_splits", [1, 8])
def test_wide_table_short_rows_leave_splits_inactive(row_splits, gen, device):
    """Rows cutting their own length, in a page table far wider than the lengths: with 8
    splits only the first few have items and the merge reads just those; with 1 the
    program writes the output."""
    q, kv = _inputs((4, 1, 32, 4, [70, 1]), gen, device)
    wide = torch.cat([kv.page_table, kv.page_table[:, :1].expand(-1, 60)], 1).contiguous()
    args = (q, kv.k_cache, kv.v_cache, wide, kv.kv_lens)
    ref = paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, return_lse=True)
    for fused in (True, False):
        out, lse = split_k_decode(*args, mode=MODE_DENSE, capacity=wide.shape[1] * 4, return_lse=True,
                                  fused_combine=fused, row_splits=row_splits)
        assert_close(out, ref[0], 1e-4, f"out fused={fused}")
        assert_close(lse, ref[1], 1e-4, f"lse fused={fused}")


def test_fp16(gen, device):
    q, kv = _inputs(CASES[1], gen, device, torch.float16)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    out = paged_decode_triton(*args, kv_chunk=32)
    assert out.dtype == torch.float16
    assert_close(out, paged_decode_ref(*args), 3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[32768, 32000], [131072]], ids=["b2-32k", "b1-128k"])
def test_gpu_bf16_long(lens, gen):
    q, kv = _inputs((32, 8, 128, 16, lens), gen, "cuda", torch.bfloat16)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    out, lse = paged_decode_triton(*args, return_lse=True)
    out_ref, lse_ref = paged_decode_ref(*args, return_lse=True)
    assert_close(out, out_ref, 2e-2, "out")
    assert_close(lse, lse_ref, 1e-3, "lse")


@pytest.mark.gpu
def test_gpu_fused_combine_in_cuda_graph(gen):
    """Graph replays reuse the counters at their fixed address: each replay merges afresh."""
    q, kv = _inputs((32, 8, 128, 16, [4096, 1000, 0]), gen, "cuda", torch.bfloat16)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    out_2k, lse_2k = _split_k(q, kv, 256, fused_combine=False)
    for _ in range(2):  # compile and allocate the counters outside the capture
        _split_k(q, kv, 256, fused_combine=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = _split_k(q, kv, 256, fused_combine=True)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, out_2k, 1e-2, "out")
        assert_close(lse, lse_2k, 1e-5, "lse")
    q.copy_(randn(*q.shape, generator=gen, dtype=q.dtype, device="cuda"))
    graph.replay()
    out_ref, lse_ref = paged_decode_ref(*args, return_lse=True)
    assert_close(out, out_ref, 2e-2, "out after new q")
    assert_close(lse, lse_ref, 1e-3, "lse after new q")


@pytest.mark.parametrize("fine_splits", [None, 3, 8])
def test_fixed_chunks_split_short_rows_finer(fine_splits, gen, device):
    """Fixed chunks over a page table far wider than the rows (a graph's, sized for
    max_model_len): a row shorter than `fine_splits` chunks cuts its own length finer, a
    long one keeps the chunk; the same attention either way, merged by either path. None:
    the auto plan, which turns it on for one request (CPU: 4 "SMs", 2 rows of Hkv 2: 8
    chunks a row wanted)."""
    lens = [70] if fine_splits is None else [70, 1, 130]
    q, kv = _inputs((4, 2, 32, 4, lens), gen, device)
    wide = torch.cat([kv.page_table, kv.page_table[:, :1].expand(-1, 300)], 1).contiguous()
    args = (q, kv.k_cache, kv.v_cache, wide, kv.kv_lens)
    ref = paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, return_lse=True)
    chunk = None if fine_splits is None else 64
    for fused in (True, False):
        out, lse = split_k_decode(*args, mode=MODE_DENSE, capacity=wide.shape[1] * 4, return_lse=True,
                                  fused_combine=fused, kv_chunk=chunk, fine_splits=fine_splits, block_n=16)
        assert_close(out, ref[0], 1e-4, f"out fused={fused}")
        assert_close(lse, ref[1], 1e-4, f"lse fused={fused}")


@pytest.mark.parametrize("min_chunk", [None, 32])
def test_rows_filling_the_gpu_split_only_long_rows(min_chunk, gen, device):
    """Per-row chunks of at least `min_chunk` items: a row of n items runs in min(splits,
    n // min_chunk) chunks (here 1, 1, 2, 3 and 3 of 4 splits); the rest of its programs
    write nothing, and a row with one chunk writes its output directly when the split
    kernel merges. Both merges, the auto plan (None: CPU rows >= 16 fill the 4 "SMs";
    min chunk 256, so every row is one chunk) and an explicit one."""
    lens = [10, 40, 64, 100, 130] * 4  # 20 requests x 1 KV head = 20 rows
    q, kv = _inputs((2, 1, 32, 4, lens), gen, device)
    cpu = torch.device("cpu")
    assert min_chunk_for(split_plan(4096, 20, cpu), 20, cpu, True) == 256
    assert min_chunk_for(split_plan(4096, 20, cpu), 20, cpu, False) == 0  # an explicit plan
    assert min_chunk_for(split_plan(4096, 8, cpu), 8, cpu, True) == 0  # between: every split has items
    assert min_chunk_for((0, 4), 20, cpu, True, min_chunk=32) == 32
    assert min_chunk_for((64, 4), 20, cpu, True, min_chunk=32) == 0  # fixed chunks
    wide = torch.cat([kv.page_table, kv.page_table[:, :1].expand(-1, 100)], 1).contiguous()
    args = (q, kv.k_cache, kv.v_cache, wide, kv.kv_lens)
    ref = paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, return_lse=True)
    plan = {} if min_chunk is None else dict(row_splits=4, min_chunk=min_chunk)
    for fused in (True, False, None):
        out, lse = split_k_decode(*args, mode=MODE_DENSE, capacity=wide.shape[1] * 4, return_lse=True,
                                  fused_combine=fused, block_n=16, **plan)
        assert_close(out, ref[0], 1e-4, f"out fused={fused}")
        assert_close(lse, ref[1], 1e-4, f"lse fused={fused}")


RAGGED = [300, 10, 0, 37, 5, 64, 12, 9]  # one row far longer than the rest, an empty one


@pytest.mark.parametrize("row_splits,min_chunk,row_block", [(1, None, None), (2, None, 4), (3, 32, None)])
def test_balanced_plan_gives_a_long_row_more_chunks(row_splits, min_chunk, row_block, gen, device, monkeypatch):
    """The balanced plan over a ragged batch: the kernel numbers each row's chunks as
    `balanced_chunks` defines (read back through `plan_out`), the 300-token row takes at
    least twice `row_splits` chunks where the per-row plan gives it `row_splits`, and the
    attention matches the reference under every merge (the merge kernel, the last program,
    the auto choice). `row_block` 4: every program reads the 16 rows' lengths in 4 blocks."""
    if row_block:
        monkeypatch.setattr(balanced_plan, "BALANCED_ROW_BLOCK", row_block)
    q, kv = _inputs((4, 2, 32, 4, RAGGED), gen, device)
    rows = len(RAGGED) * 2
    n_items = torch.tensor(RAGGED).repeat_interleave(2)
    first, k, _ = balanced_chunks(n_items, row_splits, 16, min_chunk or 0)
    assert k[0] >= 2 * row_splits and int(k.sum()) <= rows * row_splits + rows
    ref = paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, return_lse=True)
    for fused in (True, False, None):
        plan = torch.full((rows, 2), -7, dtype=torch.int32, device=device)
        out, lse = split_k_decode(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, mode=MODE_DENSE,
                                  capacity=kv.page_table.shape[1] * 4, return_lse=True, fused_combine=fused,
                                  block_n=16, row_splits=row_splits, min_chunk=min_chunk, balanced=True,
                                  plan_out=plan)
        assert torch.equal(plan.cpu().long(), torch.stack([first, k], 1)), f"plan fused={fused}"
        assert_close(out, ref[0], 1e-4, f"out fused={fused}")
        assert_close(lse, ref[1], 1e-4, f"lse fused={fused}")


def test_balanced_chunks_rule():
    """`balanced_chunks` by hand: 4 rows of 1000, 10, 0 and 90 items in 2 splits a row,
    blocks of 16: C = ceil(1100 / 8) = 138 -> 144; the long row 7 chunks of 144, the others
    one each, numbered row after row; with min_chunk 256 the long row at most 1000 // 256 =
    3 chunks (of 336). Rows of like lengths keep num_splits slots each."""
    n = torch.tensor([1000, 10, 0, 90])
    first, k, chunk = balanced_chunks(n, 2, 16)
    assert k.tolist() == [7, 1, 1, 1] and first.tolist() == [0, 7, 8, 9]
    assert chunk.tolist() == [144, 16, 16, 96]
    first, k, chunk = balanced_chunks(n, 2, 16, min_chunk=256)
    assert k.tolist() == [3, 1, 1, 1] and first.tolist() == [0, 3, 4, 5] and chunk[0] == 336
    # uniform rows: exactly the per-row plan's row_splits chunks a row, at r * row_splits
    first, k, chunk = balanced_chunks(torch.full((5,), 2304), 20, 64)
    assert k.tolist() == [18] * 5 and first.tolist() == [0, 20, 40, 60, 80] and chunk.tolist() == [128] * 5
    # like lengths (C = ceil(310 / 15) = 21 -> 32, the longest 3 chunks): row slots too
    first, k, _ = balanced_chunks(torch.tensor([80, 70, 0, 90, 70]), 3, 16)
    assert first.tolist() == [0, 3, 6, 9, 12] and k.tolist() == [3, 3, 1, 3, 3]
    # a row within slack (2) x num_splits chunks (C = ceil(270 / 8) = 34 -> 48, 150 items: 4)
    # keeps its 2 slots, in longer chunks; past it (200 items: 5) the rows are numbered on
    first, k, chunk = balanced_chunks(torch.tensor([150, 40, 40, 40]), 2, 16)
    assert first.tolist() == [0, 2, 4, 6] and k.tolist() == [2, 1, 1, 1] and chunk[0] == 80
    first, k, _ = balanced_chunks(torch.tensor([200, 40, 40, 40]), 2, 16)
    assert first.tolist() == [0, 5, 6, 7] and k.tolist() == [5, 1, 1, 1]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("lens,splits", [([80, 70, 0, 90, 70], 3), ([150, 40, 40, 40], 2)])
def test_balanced_plan_over_like_lengths_keeps_row_slots(lens, splits, fused, gen, device):
    """Rows of like lengths keep `splits` slots each, some idle (none past 3 chunks of the
    batch's chunk; or the 150-item row, within twice its 2 slots, in 2 longer chunks);
    the merge reads each row's own chunks."""
    q, kv = _inputs((4, 1, 32, 4, lens), gen, device)
    first, k, _ = balanced_chunks(torch.tensor(lens), splits, 16)
    assert first.tolist() == [r * splits for r in range(len(lens))]
    plan = torch.zeros(len(lens), 2, dtype=torch.int32, device=device)
    out, lse = split_k_decode(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, mode=MODE_DENSE,
                              capacity=kv.page_table.shape[1] * 4, return_lse=True, fused_combine=fused, block_n=16,
                              row_splits=splits, balanced=True, plan_out=plan)
    assert torch.equal(plan.cpu().long(), torch.stack([first, k], 1))
    ref = paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, return_lse=True)
    assert_close(out, ref[0], 1e-4, "out")
    assert_close(lse, ref[1], 1e-4, "lse")


def test_balanced_plan_inputs_are_checked(gen, device):
    """Which launches take the balanced plan (the auto plan's per-row chunks, up to
    MAX_BALANCED_ROWS rows; asked for explicitly), and the errors for a bad plan buffer or
    too many rows."""
    use = balanced_plan.use_balanced
    limit = balanced_plan.MAX_BALANCED_ROWS
    assert use(None, 0, True, 100) and not use(None, 2048, True, 100) and not use(None, 0, False, 100)
    assert not use(None, 0, True, limit + 1) and use(True, 2048, False, 100) and not use(False, 0, True, 100)
    with pytest.raises(ValueError, match=f"at most {limit} rows"):
        use(True, 0, True, limit + 1)
    q, kv = _inputs((4, 2, 32, 4, [20, 3]), gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    with pytest.raises(ValueError, match="plan_out must be a contiguous int32"):
        split_k_decode(*args, mode=MODE_DENSE, capacity=32, row_splits=2, balanced=True,
                       plan_out=torch.zeros(4, 2, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="balanced plan only"):
        split_k_decode(*args, mode=MODE_DENSE, capacity=32, kv_chunk=16,
                       plan_out=torch.zeros(4, 2, dtype=torch.int32, device=device))


@pytest.mark.gpu
def test_gpu_balanced_plan_follows_lengths_across_graph_replays(gen):
    """The balanced plan is computed on the device at every launch: a CUDA graph captured
    over one ragged batch (21 requests, 168 rows: the auto plan's per-row band on the H200)
    replays correctly after the lengths change (the long row moves, a row empties), with
    the plan read back through `plan_out` matching `balanced_chunks`."""
    lens = [20000] + [700 + 37 * i for i in range(20)]
    q, kv = _inputs((32, 8, 128, 16, [20000] * 21), gen, "cuda", torch.bfloat16)  # room for any row to grow
    kv.kv_lens.copy_(torch.tensor(lens, dtype=kv.kv_lens.dtype))
    capacity = kv.page_table.shape[1] * 16
    chunk, num_splits = split_plan(capacity, 168, torch.device("cuda"))
    assert chunk == 0  # the auto plan cuts rows by their own lengths here: balanced
    plan = torch.zeros(168, 2, dtype=torch.int32, device="cuda")

    def launch():
        return split_k_decode(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, mode=MODE_DENSE,
                              capacity=capacity, return_lse=True, plan_out=plan)

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = launch()
    for new_lens in (lens, [700] * 10 + [0, 19000] + [900] * 9):
        kv.kv_lens.copy_(torch.tensor(new_lens, dtype=kv.kv_lens.dtype))
        graph.replay()
        torch.cuda.synchronize()
        out_ref, lse_ref = paged_decode_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, return_lse=True)
        assert_close(out, out_ref, 2e-2, "out")
        assert_close(lse, lse_ref, 1e-3, "lse")
        first, k, _ = balanced_chunks(torch.tensor(new_lens).repeat_interleave(8), num_splits, 64)
        assert torch.equal(plan.cpu().long(), torch.stack([first, k], 1))
