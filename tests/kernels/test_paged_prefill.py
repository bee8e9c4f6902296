import pytest
import torch
import torch.nn.functional as F

from sparseengine.kernels import paged_prefill, paged_prefill_ref, paged_prefill_triton
from sparseengine.kernels.bench_prefill import PREFILL_LAUNCHES
from sparseengine.kernels.testing import CASES, assert_close, case_id, random_paged_kv, randn


def _inputs(case, gen, device, dtype=torch.float32):
    """Each request prefills a chunk at the end of its cache: first chunk, middle, 1 token."""
    hq, hkv, d, ps, lens = case
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=dtype, device=device)
    q_lens = [n if b % 3 == 0 else max(1, min(n, [1, 19][b % 3 - 1])) for b, n in enumerate(lens)]
    cu = torch.tensor([0] + q_lens, device=device).cumsum(0).int()
    q = randn(int(cu[-1]), hq, d, generator=gen, dtype=dtype, device=device)
    return q, kv, cu


def dense_prefill(q, kv, cu):
    g = q.shape[1] // kv.k_cache.shape[2]
    out = []
    for b in range(len(cu) - 1):
        qb = q[int(cu[b]):int(cu[b + 1])].float().transpose(0, 1)  # [hq, m, d]
        k, v = (x.float().repeat_interleave(g, 1).transpose(0, 1) for x in kv.dense(b))
        m, n = qb.shape[1], k.shape[1]
        mask = torch.arange(n, device=q.device)[None, :] <= (n - m + torch.arange(m, device=q.device))[:, None]
        out.append(F.scaled_dot_product_attention(qb, k, v, attn_mask=mask).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ref_matches_dense(case, gen, device):
    q, kv, cu = _inputs(case, gen, device)
    out = paged_prefill_ref(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu)
    assert_close(out, dense_prefill(q, kv, cu), 1e-5)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_matches_ref(case, gen, device):
    q, kv, cu = _inputs(case, gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu)
    out_ref, lse_ref = paged_prefill_ref(*args, return_lse=True)
    out, lse = paged_prefill_triton(*args, return_lse=True)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(lse, lse_ref, 1e-4, "lse")
    max_q_len = int((cu[1:] - cu[:-1]).max())
    assert_close(paged_prefill_triton(*args, max_q_len=max_q_len), out_ref, 1e-4, "max_q_len")


# small tiles and key blocks, so a chunk spans several tiles and its early key blocks are
# whole for every row of a tile (the split's unmasked loop runs), with partial last blocks
CPU_LAUNCHES = [dict(block_rows=16, block_n=16, split_mask=True), dict(block_rows=32, block_n=16, split_mask=True),
                dict(block_rows=16, block_n=32, num_warps=2, split_mask=True),
                dict(block_rows=16, block_n=16, split_mask=False)]


@pytest.mark.parametrize("launch", CPU_LAUNCHES, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=case_id)
def test_launches_match_ref(case, launch, gen, device):
    q, kv, cu = _inputs(case, gen, device)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu)
    out_ref, lse_ref = paged_prefill_ref(*args, return_lse=True)
    out, lse = paged_prefill_triton(*args, return_lse=True, **launch)
    assert_close(out, out_ref, 1e-4, "out")
    assert_close(lse, lse_ref, 1e-4, "lse")


@pytest.mark.parametrize("bad, message", [
    (dict(block_rows=48), "block_rows must be a power of two >= 16"),
    (dict(block_n=8), "block_n must be a power of two >= 16"),
    (dict(num_warps=0), "num_warps must be an int >= 1"),
    (dict(num_stages=2.0), "num_stages must be an int >= 1"),
])
def test_bad_launch_is_an_error(bad, message, gen, device):
    q, kv, cu = _inputs(CASES[0], gen, device)
    with pytest.raises(ValueError, match=message):
        paged_prefill_triton(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu, **bad)
    with pytest.raises(TypeError):
        paged_prefill_triton(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu, block_m=16)


@pytest.mark.parametrize("major, head_dim, tuned", [(9, 128, True), (9, 64, True), (9, 256, False), (8, 128, False),
                                                   (10, 128, False)])
def test_default_launch_by_device(monkeypatch, major, head_dim, tuned):
    """The H200-tuned launch only on sm_90 at head dim <= 128 (its tiles' shared memory) and
    when every request brings SM90_MIN_Q_LEN tokens; elsewhere, and on the CPU, the small
    tiles; a given argument always wins."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    sm90 = paged_prefill.PrefillLaunch(**paged_prefill.SM90_LAUNCH)
    long_rows = paged_prefill.SM90_MIN_Q_LEN
    got = paged_prefill.prefill_launch(device="cuda", head_dim=head_dim, min_q_len=long_rows)
    assert (got == sm90) is tuned
    # a request of fewer tokens (a decode row of a mixed step), or none said: the small tiles
    for short in (long_rows - 1, None):
        assert paged_prefill.prefill_launch(device="cuda", head_dim=head_dim, min_q_len=short).block_rows == 64
    assert paged_prefill.prefill_launch(device="cpu", head_dim=head_dim, min_q_len=long_rows).block_rows == 64
    assert paged_prefill.prefill_launch(num_warps=2, device="cuda", head_dim=head_dim,
                                        min_q_len=long_rows).num_warps == 2
    assert dict(paged_prefill.SM90_LAUNCH) in [dict(kw) for kw in PREFILL_LAUNCHES]  # the GPU test runs it


def test_fp16(gen, device):
    q, kv, cu = _inputs(CASES[2], gen, device, torch.float16)
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu)
    assert_close(paged_prefill_triton(*args), paged_prefill_ref(*args), 3e-3)


@pytest.mark.gpu
def test_gpu_bf16_chunk_over_32k(gen):
    lens = [32768, 4000, 700]
    kv = random_paged_kv(lens, 8, 128, 16, generator=gen, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, 96, 96 + 4000, 96 + 4000 + 1], device="cuda").int()
    q = randn(int(cu[-1]), 32, 128, generator=gen, dtype=torch.bfloat16, device="cuda")
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, cu)
    want = dense_prefill(q, kv, cu).to(torch.bfloat16)
    for launch in PREFILL_LAUNCHES:  # every launch the benchmark sweeps
        assert_close(paged_prefill_triton(*args, **launch), want, 2e-2, str(launch))
