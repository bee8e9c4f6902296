import pytest
import torch
import torch.nn.functional as F

from sparseengine.kernels import (sparse_decode_ref, sparse_decode_triton, sparse_page_decode_ref,
                                  sparse_page_decode_triton, sparse_rows_decode_ref, sparse_rows_decode_triton)
from sparseengine.kernels.testing import CASES, assert_close, case_id, random_paged_kv, randn


def _inputs(case, gen, device, dtype=torch.float32):
    hq, hkv, d, ps, lens = case
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=dtype, device=device)
    return randn(len(lens), hq, d, generator=gen, dtype=dtype, device=device), kv


def _token_selection(lens, hkv, K, gen, device):
    """Distinct ids per row; entries past num_selected are garbage that must be ignored."""
    idx = torch.full((len(lens), hkv, K), 10**6, dtype=torch.int32)
    num = torch.zeros(len(lens), hkv, dtype=torch.int32)
    for b, n in enumerate(lens):
        for h in range(hkv):
            c = int(torch.randint(0, min(n, K) + 1, (1,), generator=gen)) if h else min(n, K)
            idx[b, h, :c] = torch.randperm(n, generator=gen)[:c].int()
            num[b, h] = c
    return idx.to(device), num.to(device)


def _page_selection(lens, hkv, ps, P, gen, device):
    idx = torch.full((len(lens), hkv, P), -7, dtype=torch.int32)
    num = torch.zeros(len(lens), hkv, dtype=torch.int32)
    for b, n in enumerate(lens):
        pages = -(-n // ps)
        for h in range(hkv):
            c = min(pages, P) if h == 0 else int(torch.randint(0, min(pages, P) + 1, (1,), generator=gen))
            chosen = torch.randperm(pages, generator=gen)[:c]
            if h == 0 and c:
                chosen[0] = pages - 1  # the partial last page
            idx[b, h, :c] = chosen.int()
            num[b, h] = c
    return idx.to(device), num.to(device)


def dense_selected(q, kv, tokens_of):
    B, hq, d = q.shape
    hkv = kv.k_cache.shape[2]
    g = hq // hkv
    out = torch.zeros(B, hq, d, device=q.device)
    for b in range(B):
        k, v = kv.dense(b)
        for h in range(hkv):
            t = tokens_of(b, h)
            if len(t):
                qg = q[b, h * g:(h + 1) * g].float()[:, None]
                out[b, h * g:(h + 1) * g] = F.scaled_dot_product_attention(
                    qg, k[t, h].float()[None].expand(g, -1, -1), v[t, h].float()[None].expand(g, -1, -1))[:, 0]
    return out


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tokens(case, gen, device):
    q, kv = _inputs(case, gen, device)
    lens = case[4]
    idx, num = _token_selection(lens, case[1], 24, gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, idx, num)
    out_ref, lse_ref = sparse_decode_ref(*args, return_lse=True)
    assert_close(out_ref, dense_selected(q, kv, lambda b, h: idx[b, h, :num[b, h]].long()), 1e-5, "ref")
    out, lse = sparse_decode_triton(*args, return_lse=True, kv_chunk=16)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(lse, lse_ref, 1e-4, "lse")


def pool_rows_of(page_table, idx, num, page_size):
    """Each counted entry's pool row (page * page_size + offset), -1 elsewhere."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    tok = torch.where(valid, idx, 0).long()
    rows = page_table.long().gather(1, (tok // page_size).flatten(1)).view_as(tok) * page_size + tok % page_size
    return torch.where(valid, rows, -1).int()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rows(case, gen, device):
    """The rows variant over a token selection's pool rows attends what the token variant
    does over the tokens (reference and kernel), a negative entry skipped, and with the
    selection shared by the KV heads (OmniKV's stride-0 view) at the default launch."""
    q, kv = _inputs(case, gen, device)
    hq, hkv, d, ps, lens = case
    idx, num = _token_selection(lens, hkv, 24, gen, device)
    base = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    rows = pool_rows_of(kv.page_table, idx, num, ps)
    out_ref, lse_ref = sparse_decode_ref(*base, idx, num, return_lse=True)
    out, lse = sparse_rows_decode_ref(q, kv.k_cache, kv.v_cache, rows, num, return_lse=True)
    assert_close(out, out_ref, 1e-5, "rows ref")
    assert_close(lse, lse_ref, 1e-5, "rows ref lse")
    out, lse = sparse_rows_decode_triton(*base, rows, num, return_lse=True, kv_chunk=16, block_n=16)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(lse, lse_ref, 1e-4, "lse")
    skipped = rows.clone()
    skipped[:, :, 0] = -1  # every row's first entry: the tokens variant without it
    without = torch.cat([idx[:, :, 1:], idx[:, :, :1]], -1)
    fewer = (num - 1).clamp(min=0)
    out_ref = sparse_decode_ref(*base, without, fewer)
    assert_close(sparse_rows_decode_triton(*base, skipped, num, kv_chunk=16, block_n=16), out_ref, 1e-4, "skipped")
    shared, shared_num = rows[:, :1].expand_as(rows), num[:, :1].expand_as(num).contiguous()
    out_ref = sparse_decode_ref(*base, idx[:, :1].expand_as(idx), shared_num)
    assert_close(sparse_rows_decode_triton(*base, shared, shared_num), out_ref, 1e-4, "shared")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_pages(case, gen, device):
    q, kv = _inputs(case, gen, device)
    hq, hkv, d, ps, lens = case
    idx, num = _page_selection(lens, hkv, ps, 5, gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, idx, num)
    out_ref, lse_ref = sparse_page_decode_ref(*args, return_lse=True)

    def tokens_of(b, h):
        t = (idx[b, h, :num[b, h]].long()[:, None] * ps + torch.arange(ps, device=device)).flatten()
        return t[t < lens[b]]

    assert_close(out_ref, dense_selected(q, kv, tokens_of), 1e-5, "ref")
    out, lse = sparse_page_decode_triton(*args, return_lse=True, kv_chunk=16)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(lse, lse_ref, 1e-4, "lse")


def _matches_ref(ref, triton_fn, args):
    """The Triton attention's output and lse equal the reference's (float32 rounding)."""
    out_ref, lse_ref = ref(*args, return_lse=True)
    out, lse = triton_fn(*args, return_lse=True)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(lse, lse_ref, 1e-4, "lse")


@pytest.mark.parametrize("merge", [None, True, False])
def test_the_page_launch_constants_are_read_at_each_call(merge, monkeypatch, gen, device):
    """sparse_decode.PAGE_CHUNK and PAGE_MERGE_IN_SPLIT (the launch for rows too few to fill
    the GPU, A/B-able) are read at each call: 16-token splits merged by the merge launch or
    by each row's last split give the reference's attention, and a chunk that is not a power
    of two is refused by name."""
    from sparseengine.kernels import sparse_decode

    hq, hkv, d, ps, lens = 8, 2, 32, 4, [70, 33]
    q, kv = _inputs((hq, hkv, d, ps, lens), gen, device)
    idx, num = _page_selection(lens, hkv, ps, 18, gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, idx, num)
    monkeypatch.setattr(sparse_decode, "PAGE_CHUNK", 16)
    monkeypatch.setattr(sparse_decode, "PAGE_MERGE_IN_SPLIT", merge)
    _matches_ref(sparse_page_decode_ref, sparse_page_decode_triton, args)
    monkeypatch.setattr(sparse_decode, "PAGE_CHUNK", 24)
    with pytest.raises(ValueError, match="kv_chunk must be a power of two >= 16, got 24"):
        sparse_page_decode_triton(*args)


@pytest.mark.parametrize("chunk", [16, 32])
def test_the_token_launch_constants_are_read_at_each_call(chunk, monkeypatch, gen, device):
    """sparse_decode.TOKEN_CHUNK (with TOKEN_BLOCK_N, TOKEN_STAGES: the token variant's
    launch for rows too few to fill the GPU, A/B-able) is read at each call: fixed chunks
    of chosen tokens give the reference's attention, also with a selection shared by the
    KV heads (OmniKV's stride-0 view), and a chunk that is not a power of two is refused."""
    from sparseengine.kernels import sparse_decode

    hq, hkv, d, ps, lens = 8, 2, 32, 4, [70, 33]
    q, kv = _inputs((hq, hkv, d, ps, lens), gen, device)
    idx, num = _token_selection(lens, hkv, 40, gen, device)
    shared = idx[:, :1].expand_as(idx)  # every KV head the first head's choice
    shared_num = num[:, :1].expand_as(num).contiguous()
    monkeypatch.setattr(sparse_decode, "TOKEN_BLOCK_N", 16)
    for sel, n in ((idx, num), (shared, shared_num)):
        args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, sel, n)
        monkeypatch.setattr(sparse_decode, "TOKEN_CHUNK", chunk)
        _matches_ref(sparse_decode_ref, sparse_decode_triton, args)
    monkeypatch.setattr(sparse_decode, "TOKEN_CHUNK", 24)
    with pytest.raises(ValueError, match="kv_chunk must be a power of two >= 16, got 24"):
        sparse_decode_triton(*args)


def test_full_selection_is_dense(gen, device):
    from sparseengine.kernels import paged_decode_ref

    q, kv = _inputs(CASES[1], gen, device)
    lens, hkv = CASES[1][4], CASES[1][1]
    K = max(lens)
    idx = torch.arange(K, device=device, dtype=torch.int32).expand(len(lens), hkv, K).contiguous()
    num = torch.tensor(lens, device=device, dtype=torch.int32)[:, None].expand(-1, hkv).contiguous()
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    assert_close(sparse_decode_triton(*args, idx, num), paged_decode_ref(*args), 1e-4)


@pytest.mark.gpu
def test_gpu_bf16_32k(gen):
    lens, hkv = [32768, 20000], 8
    q, kv = _inputs((32, hkv, 128, 16, lens), gen, "cuda", torch.bfloat16)
    idx, num = _token_selection(lens, hkv, 2048, gen, "cuda")
    pidx, pnum = _page_selection(lens, hkv, 16, 128, gen, "cuda")
    base = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    assert_close(sparse_decode_triton(*base, idx, num), sparse_decode_ref(*base, idx, num), 2e-2)
    assert_close(sparse_page_decode_triton(*base, pidx, pnum), sparse_page_decode_ref(*base, pidx, pnum), 2e-2)


@pytest.mark.parametrize("mode", ["tokens", "pages"])
def test_balanced_plan_over_selections(mode, gen, device):
    """The balanced plan reads each (request, KV head) row's own count (selections differ
    by head, one row far longer): the same attention as the reference, with the
    `balanced_chunks` plan over those counts."""
    from sparseengine.kernels.paged_decode import MODE_PAGES, MODE_TOKENS, split_k_decode
    from sparseengine.kernels.balanced_plan import balanced_chunks

    hq, hkv, d, ps, lens = 4, 2, 32, 4, [200, 30, 9, 50]
    q, kv = _inputs((hq, hkv, d, ps, lens), gen, device)
    if mode == "tokens":
        idx, num = _token_selection(lens, hkv, 160, gen, device)
        ref, per_row, kw = sparse_decode_ref, num.flatten().cpu(), dict(mode=MODE_TOKENS, capacity=160)
    else:
        idx, num = _page_selection(lens, hkv, ps, 40, gen, device)
        ref, per_row, kw = sparse_page_decode_ref, num.flatten().cpu() * ps, dict(mode=MODE_PAGES, capacity=160)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens)
    out_ref, lse_ref = ref(*args, idx, num, return_lse=True)
    first, k, _ = balanced_chunks(per_row, 2, 16)
    assert k.max() > 2  # the long rows take more chunks than the 2 a row of the grid
    for fused in (True, False):
        plan = torch.zeros(8, 2, dtype=torch.int32, device=device)
        out, lse = split_k_decode(*args, sel=idx, num_sel=num, return_lse=True, row_splits=2, balanced=True,
                                  fused_combine=fused, block_n=16, plan_out=plan, **kw)
        assert torch.equal(plan.cpu().long(), torch.stack([first, k], 1))
        assert_close(out, out_ref, 1e-4, f"out fused={fused}")
        assert_close(lse, lse_ref, 1e-4, f"lse fused={fused}")
