"""DeltaKV's nearest-center search against its definition (L2 distance in kv space among
the centers before each token, nearest first, -1 padded), with the centers split between
each layer's stored ones and the new ones in every proportion; the gathered rows and
their mean against plain indexing."""
import pytest
import torch

from sparseengine.methods.deltakv_nearest import gather_centers, nearest_centers, neighbor_mean


def _brute(centers, stride, kv, pos, k):
    """Plain loops in float64: [m, k] indices of the nearest centers before each token."""
    out = []
    for x, p in zip(kv.double(), pos.tolist()):
        cand = sorted((float((x - c.double()).norm()), i) for i, c in enumerate(centers) if i * stride < p)
        near = [i for _, i in cand[:k]]
        out.append(near + [-1] * (k - len(near)))
    return out


def _layers(L, c, m, dim, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(L, c, dim, generator=g)
    kv = centers[:, torch.randint(0, c, (m,), generator=g)] + 0.2 * torch.randn(L, m, dim, generator=g)
    return centers.to(dtype).to(device), kv.to(dtype).to(device)


@pytest.mark.parametrize("c_old", [0, 3, 9, 12])  # every center new, some, none
@pytest.mark.parametrize("chunk_elems", [1 << 25, 1])  # one chunk; a token a chunk
def test_nearest_centers_match_brute_force(c_old, chunk_elems):
    L, c, m, dim, stride, k = 3, 12, 20, 16, 4, 3
    centers, kv = _layers(L, c, m, dim, seed=c_old)
    pos = torch.randint(0, c * stride + 2, (m,), generator=torch.Generator().manual_seed(1))
    pos[0] = 0  # no center before it: all -1
    olds = [centers[i, :c_old] for i in range(L)]
    got = nearest_centers(olds, centers[:, c_old:], stride, kv, pos, k, chunk_elems=chunk_elems)
    assert got.shape == (L, m, k) and got.dtype == torch.long
    for i in range(L):
        assert got[i].tolist() == _brute(centers[i], stride, kv[i], pos, k), f"layer {i}"
    assert got[:, 0].eq(-1).all()


def test_nearest_centers_with_fewer_centers_than_neighbours():
    centers, kv = _layers(1, 2, 5, 8, seed=4)
    pos = torch.tensor([1, 5, 9, 13, 40])
    got = nearest_centers([centers[0, :1]], centers[:, 1:], 4, kv, pos, 3)
    assert got[0].tolist() == _brute(centers[0], 4, kv[0], pos, 3)
    assert got[0, -1, 2] == -1  # two centers, three neighbours asked


@pytest.mark.parametrize("c_old,c_new", [(0, 5), (5, 0), (3, 2)])
def test_gathered_rows_and_their_mean_follow_the_indices(c_old, c_new):
    L, dim = 2, 6
    centers = torch.randn(L, c_old + c_new, dim, generator=torch.Generator().manual_seed(7)).bfloat16()
    idx = torch.randint(-1, c_old + c_new, (L, 4, 3), generator=torch.Generator().manual_seed(8))
    idx[0, 0] = -1  # a token with no neighbour: mean zero
    rows = gather_centers([centers[i, :c_old] for i in range(L)], centers[:, c_old:], idx)
    assert rows.dtype == torch.bfloat16 and rows.shape == (L, 4, 3, dim)
    for i in range(L):
        for t in range(4):
            for j in range(3):
                if idx[i, t, j] >= 0:
                    assert torch.equal(rows[i, t, j], centers[i, idx[i, t, j]])
    mean = neighbor_mean(rows, idx)
    for i in range(L):
        for t in range(4):
            named = [centers[i, j].float() for j in idx[i, t].tolist() if j >= 0]
            want = torch.stack(named).mean(0) if named else torch.zeros(dim)
            torch.testing.assert_close(mean[i, t], want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_16bit_search_matches_brute_force(dtype):
    """On a GPU, 16-bit kv takes the 16-bit GEMM with float32 output: same neighbours as
    float64 loops over the same 16-bit values."""
    L, c, m, dim, stride, k = 2, 40, 48, 256, 10, 4
    centers, kv = _layers(L, c, m, dim, seed=11, dtype=dtype, device="cuda")
    pos = torch.randint(1, c * stride, (m,), generator=torch.Generator().manual_seed(2)).cuda()
    got = nearest_centers([centers[i, :30] for i in range(L)], centers[:, 30:], stride, kv, pos, k)
    for i in range(L):
        assert got[i].tolist() == _brute(centers[i].cpu(), stride, kv[i].cpu(), pos.cpu(), k), f"layer {i}"
