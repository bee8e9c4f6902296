import pytest
import torch

from sparseengine.kernels import omnikv_scores_ref, omnikv_scores_triton, paged_decode_triton
from sparseengine.kernels.testing import CASES, assert_close, case_id, random_paged_kv, randn


def _inputs(case, gen, device, dtype=torch.float32):
    hq, hkv, d, ps, lens = case
    kv = random_paged_kv(lens, hkv, d, ps, generator=gen, dtype=dtype, device=device)
    return randn(len(lens), hq, d, generator=gen, dtype=dtype, device=device), kv


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("mode", ["logits", "probs"])
def test_scores(case, mode, gen, device):
    hq, hkv, d, ps, lens = case
    q, kv = _inputs(case, gen, device)
    L = max(lens) + 2
    args = (q, kv.k_cache, kv.page_table, kv.kv_lens, mode, L)
    ref = omnikv_scores_ref(*args)
    dense = torch.full((len(lens), L), float("-inf"), device=device)
    for b, n in enumerate(lens):  # plainest: one query head at a time
        k = kv.dense(b)[0]
        for h in range(hq):
            s = k[:, h // (hq // hkv)] @ q[b, h] / d**0.5
            dense[b, :n] = torch.maximum(dense[b, :n], s.softmax(0) if mode == "probs" else s)
    assert_close(ref, dense, 1e-5, "ref")
    assert_close(omnikv_scores_triton(*args), ref, 1e-4, "triton")
    if mode == "probs":  # lse from the filter layer's own attention
        _, lse = paged_decode_triton(q, kv.k_cache, kv.v_cache, kv.page_table, kv.kv_lens, return_lse=True)
        assert_close(omnikv_scores_triton(*args, lse=lse), ref, 1e-4, "given lse")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["logits", "probs"])
def test_gpu_bf16_32k(mode, gen):
    q, kv = _inputs((32, 8, 128, 16, [32768, 7000]), gen, "cuda", torch.bfloat16)
    args = (q, kv.k_cache, kv.page_table, kv.kv_lens, mode)
    assert_close(omnikv_scores_triton(*args), omnikv_scores_ref(*args), 2e-2)
