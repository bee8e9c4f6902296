"""DeltaKV's neighbourhoods: each token's nearest earlier centers, and their mean
(METHODS.md, deltakv: "nearest" is L2 distance in kv space among earlier centers).

The centers a search sees come in two parts: each layer's ``olds`` (the stored history's
centers, one tensor a layer: the codec stores' buffers, read where they are) and ``new``
``[L, c_new, D]`` (the centers of the tokens being encoded, stacked by layer). Nothing
concatenates them: a history flush at 128K would otherwise copy every layer's 13K stored
centers (1.4 GB for a Llama-3.1-8B request) to search 64 tokens.

Distances are ``|x|^2 - 2 x.c + |c|^2`` in float32. For 16-bit kv on a GPU, ``x.c`` is one
16-bit GEMM with float32 output (``torch.mm(..., out_dtype=float32)``: the products of two
16-bit numbers are exact in float32, the sums are float32), so the centers are never
copied to float32; elsewhere (and on a torch whose GEMMs lack ``out_dtype``) both sides are
converted to float32 first.
"""

from __future__ import annotations

import functools

import torch

HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _mm_out_dtype() -> bool:
    """Whether this torch's CUDA GEMMs take ``out_dtype`` (16-bit inputs, float32 output);
    older builds convert both sides to float32 instead."""
    try:
        a = torch.ones(1, 1, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _dots(x: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """``x [..., m, D] . centers [..., c, D]^T`` as float32 ``[..., m, c]`` (2-D or 3-D)."""
    if x.is_cuda and x.dtype in HALF and centers.dtype == x.dtype and _mm_out_dtype():
        mm = torch.mm if x.dim() == 2 else torch.bmm
        return mm(x, centers.transpose(-1, -2), out_dtype=torch.float32)
    return x.float() @ centers.float().transpose(-1, -2)


def _norms(centers: torch.Tensor) -> torch.Tensor:
    """``|c|`` of each row, float32, without a float32 copy of the rows."""
    return torch.linalg.vector_norm(centers, dim=-1, dtype=torch.float32)


def nearest_centers(olds: list[torch.Tensor], new: torch.Tensor, stride: int, kv: torch.Tensor, pos: torch.Tensor,
                    neighbors: int, chunk_elems: int = 1 << 25) -> torch.Tensor:
    """Indices ``[L, m, neighbors]`` (nearest first, -1 padded) of the centers nearest to
    tokens ``kv [L, m, D]`` at positions ``pos [m]``, among layer l's centers ``olds[l]``
    then ``new[l]`` (index ``i`` is the center at position ``i * stride``), those before
    each token only."""
    L, m = kv.shape[0], kv.shape[1]
    c_old, c_new = olds[0].shape[0], new.shape[1]
    c = c_old + c_new
    out = torch.full((L, m, neighbors), -1, dtype=torch.long, device=kv.device)
    take = min(neighbors, c)
    if m == 0 or take == 0:
        return out
    c_sq = torch.cat([torch.stack([_norms(o) for o in olds]), _norms(new)], dim=1).square()[:, None, :]  # [L, 1, c]
    c_pos = torch.arange(c, device=kv.device) * stride
    rows = max(1, chunk_elems // (L * c))
    for start in range(0, m, rows):  # chunks bound the [L, rows, c] distance matrices
        x = kv[:, start:start + rows]
        dots = torch.cat([torch.stack([_dots(x[i], olds[i]) for i in range(L)]), _dots(x, new)], dim=2)
        xf = x.float()
        dist = (xf * xf).sum(dim=-1, keepdim=True) - 2.0 * dots + c_sq
        dist = dist.masked_fill(c_pos[None, None, :] >= pos[None, start:start + rows, None], float("inf"))
        val, idx = torch.topk(dist, take, dim=-1, largest=False, sorted=True)
        out[:, start:start + rows, :take] = idx.masked_fill(torch.isinf(val), -1)
    return out


def gather_centers(olds: list[torch.Tensor], new: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The center rows ``[L, m, K, D]`` (the centers' dtype) that ``idx [L, m, K]`` names
    (-1 names any row; :func:`neighbor_mean` gives it no weight)."""
    c_old, c_new = olds[0].shape[0], new.shape[1]
    safe = idx.long().clamp(min=0)
    layer = torch.arange(new.shape[0], device=idx.device)[:, None, None]
    if c_old == 0:
        return new[layer, safe]
    old = torch.stack([o[s] for o, s in zip(olds, safe.clamp(max=c_old - 1))])
    if c_new == 0:
        return old
    return torch.where((safe >= c_old)[..., None], new[layer, (safe - c_old).clamp(min=0)], old)


def neighbor_mean(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Mean ``[..., m, D]`` (float32) of the gathered center ``rows [..., m, K, D]`` that
    ``idx [..., m, K]`` names (-1 = none)."""
    valid = idx >= 0
    weight = valid / valid.sum(dim=-1, keepdim=True).clamp(min=1)  # [..., m, K]: 1/count where valid
    return torch.einsum("...mk,...mkd->...md", weight, rows.float())
