import pytest
import torch

from sparseengine.kernels import paged_kv_write_ref, paged_kv_write_triton
from sparseengine.kernels.testing import CASES, case_id, randn


def _slots(num_pages, page_size, T, gen):
    slots = torch.randperm(num_pages * page_size, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[: T // 4]] = -1  # padding tokens
    return slots


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_write(case, cache_dtype, gen, device):
    _, hkv, d, ps, lens = case
    num_pages, T = 9, 13
    cache = lambda: torch.full((num_pages, ps, hkv, d), float("nan"), dtype=cache_dtype, device=device)  # noqa: E731
    k, v = randn(T, hkv, d, generator=gen, device=device), randn(T, hkv, d, generator=gen, device=device)
    slots = _slots(num_pages, ps, T, gen).to(device)
    k_ref, v_ref, k_tri, v_tri = cache(), cache(), cache(), cache()
    paged_kv_write_ref(k, v, k_ref, v_ref, slots)
    paged_kv_write_triton(k, v, k_tri, v_tri, slots)
    for ref, tri, src in ((k_ref, k_tri, k), (v_ref, v_tri, v)):
        assert torch.equal(ref.isnan(), tri.isnan())
        assert torch.equal(ref.nan_to_num(), tri.nan_to_num())
        # plainest check: the flat slot rows hold the tokens, every other slot is untouched
        flat = ref.reshape(-1, hkv, d)
        keep = slots >= 0
        assert torch.equal(flat[slots[keep]], src[keep].to(cache_dtype))
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
        untouched[slots[keep]] = False
        assert flat[untouched].isnan().all()


def test_write_strided_input(gen, device):
    """k/v as views of a fused qkv buffer (token stride != Hkv * d)."""
    hkv, d, ps, T = 2, 32, 4, 7
    qkv = randn(T, 8, d, generator=gen, device=device)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    caches = [torch.zeros(5, ps, hkv, d, device=device) for _ in range(4)]
    slots = torch.tensor([0, 3, 4, 9, -1, 18, 7], device=device)
    paged_kv_write_ref(k, v, caches[0], caches[1], slots)
    paged_kv_write_triton(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
