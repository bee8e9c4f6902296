"""Chunked-prefill attention over the paged KV cache.

New query tokens of B requests are packed `q [T, Hq, d]`, request b owning rows
`cu_q_lens[b]:cu_q_lens[b+1]`. Its new K/V are already written at the end of its cache,
so query i of request b sits at absolute position `kv_lens[b] - q_len_b + i` and sees
cache tokens at positions `<=` that (causal).

Triton: flash-attention tiles. One program per (request, tile of BLOCK_M query tokens,
KV head); the tile's rows are the BLOCK_M tokens x the g query heads of the KV head
(GQA packing), so each K/V tile is read once per group. KV tiles past the tile's last
position are never loaded. `max_q_len` (host int), if the caller knows it, shrinks the
grid; otherwise T bounds it with no device sync (CUDA-graph safe).

The launch (`PrefillLaunch`): `block_rows` rows a tile (tokens x padded group), `block_n`
keys a step, `num_warps`, `num_stages`, and `split_mask`: the key blocks every row of the
tile sees whole (below its first row's position) run first with no masking, then the
rest (the diagonal) masked; off, every block is masked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import _common
from ._common import LOG2E, cdiv, check_cache, check_launch, lazy_jit, next_pow2
from .causal_block import causal_paged_block

if TYPE_CHECKING:  # bound by _common.LazyKernel at first launch: importing needs no Triton
    import triton.language as tl


def paged_prefill_ref(q, k_cache, v_cache, page_table, kv_lens, cu_q_lens, scale=None, return_lse=False):
    """q `[T, Hq, d]` -> out `[T, Hq, d]` (and lse `[T, Hq]` fp32, natural log)."""
    T, Hq, d = q.shape
    _, Hkv = check_cache(k_cache, Hq, d)
    g, scale = Hq // Hkv, _common.default_scale(d, scale)
    out = torch.zeros(T, Hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((T, Hq), float("-inf"), device=q.device)
    for b in range(page_table.shape[0]):
        start, end, n = int(cu_q_lens[b]), int(cu_q_lens[b + 1]), int(kv_lens[b])
        k = _common.gather_tokens(k_cache, page_table[b], torch.arange(n, device=q.device))
        v = _common.gather_tokens(v_cache, page_table[b], torch.arange(n, device=q.device))
        m = end - start
        visible = torch.arange(n, device=q.device)[None, :] <= (n - m + torch.arange(m, device=q.device))[:, None]
        for h in range(Hkv):
            heads = slice(h * g, (h + 1) * g)
            s = torch.einsum("mgd,nd->mgn", q[start:end, heads].float(), k[:, h].float()) * scale
            s = s.masked_fill(~visible[:, None, :], float("-inf"))
            lse[start:end, heads] = torch.logsumexp(s, dim=-1)
            out[start:end, heads] = torch.einsum("mgn,nd->mgd", torch.softmax(s, dim=-1), v[:, h].float())
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


# The launch's defaults, read at each call (benchmarks and tests sweep them). On sm_90 with
# head dim <= 128, SM90_LAUNCH replaces them (None: off); measured on the H200 (session 34,
# `bench_gpu --prefill-launches`, results/prefill_launches_h200.jsonl): 455-475 TFLOP/s at
# 32K and 128K against 248-275 for 64 x 64 tiles, 4 warps, 2 stages, every block masked.
# Its tiles take most of the H200's shared memory (256 x 256 keys no longer fits), and a
# tile of 256 rows spends 4x the small tile's dots on a request of one query token (a
# decode row of a mixed step), so it applies only when the caller says every request
# brings at least SM90_MIN_Q_LEN tokens (`min_q_len`). Elsewhere (and under the
# interpreter) the small tiles stay, with the unmasked blocks split off (+26-37% on the H200).
BLOCK_ROWS, BLOCK_N, NUM_WARPS, NUM_STAGES, SPLIT_MASK = 64, 64, 4, 2, True
SM90_LAUNCH = dict(block_rows=256, block_n=128, num_warps=8, num_stages=3, split_mask=True)
SM90_MIN_Q_LEN = 64


@dataclass(frozen=True)
class PrefillLaunch:
    """The chunked prefill's launch (module docstring); `prefill_launch()` fills what a call
    leaves out from the module's defaults at that call."""
    block_rows: int
    block_n: int
    num_warps: int
    num_stages: int
    split_mask: bool

    def __post_init__(self):
        for name in ("block_rows", "block_n", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("block_rows", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (a tl.dot side), got {value}")


def prefill_launch(block_rows=None, block_n=None, num_warps=None, num_stages=None, split_mask=None, *,
                   device=None, head_dim=None, min_q_len=None) -> PrefillLaunch:
    """A `PrefillLaunch` with each argument left None taken from the module's defaults now:
    `SM90_LAUNCH`'s on a CUDA `device` of compute capability 9.x with `head_dim` <= 128 and
    `min_q_len` (the fewest query tokens of any request) >= `SM90_MIN_Q_LEN`."""
    base = dict(block_rows=BLOCK_ROWS, block_n=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
                split_mask=SPLIT_MASK)
    if (SM90_LAUNCH is not None and device is not None and torch.device(device).type == "cuda"
            and (head_dim or 0) <= 128 and (min_q_len or 0) >= SM90_MIN_Q_LEN
            and torch.cuda.get_device_capability(device)[0] == 9):
        base.update(SM90_LAUNCH)
    given = dict(block_rows=block_rows, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                 split_mask=split_mask)
    base.update({k: v for k, v in given.items() if v is not None})
    return PrefillLaunch(**{**base, "split_mask": bool(base["split_mask"])})


def paged_prefill_triton(q, k_cache, v_cache, page_table, kv_lens, cu_q_lens, scale=None, return_lse=False,
                         *, max_q_len=None, min_q_len=None, skip_one_row=False, **launch):
    """`min_q_len` (host int, optional): the fewest query tokens of any request computed,
    which lets the launch take larger tiles (`prefill_launch`). `skip_one_row`: requests
    with a single query row are not computed and their rows of `out` (and `lse`) are left
    unwritten, for the caller to fill from the split-K decode (a mixed step's decode rows:
    here one program per KV head would read the row's whole cache alone, and a tile of
    `block_rows` rows would hold `g` real ones). `launch`: `prefill_launch`'s arguments
    (block_rows, block_n, num_warps, num_stages, split_mask); a group wider than
    `block_rows` takes one token a tile."""
    T, Hq, d = q.shape
    cfg = prefill_launch(**launch, device=q.device, head_dim=d, min_q_len=min_q_len)
    page_size, Hkv = check_cache(k_cache, Hq, d)
    device = check_launch(q, k_cache, v_cache, page_table, kv_lens, cu_q_lens)
    _common.check_dtypes(q, k_cache, v_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    B, g = page_table.shape[0], Hq // Hkv
    out = _common.empty((T, Hq, d), q.dtype, device)
    lse = _common.empty((T, Hq), torch.float32, device) if return_lse else out
    if T == 0:
        return (out, lse) if return_lse else out
    g_pad = next_pow2(g)
    block_m = max(1, cfg.block_rows // g_pad)  # tokens per tile
    n_tiles = cdiv(max_q_len if max_q_len is not None else T, block_m)
    _prefill_kernel[(B, n_tiles, Hkv)](
        q, k_cache, v_cache, out, lse, page_table, kv_lens, cu_q_lens,
        _common.default_scale(d, scale) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), Hq,
        GROUP=g, G_PAD=g_pad, BLOCK_M=block_m, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)),
        PAGE_SIZE=page_size, BLOCK_N=cfg.block_n, STORE_LSE=return_lse, SPLIT_MASK=cfg.split_mask,
        MIN_ROWS=2 if skip_one_row else 1, DOT_PREC=_common.dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return (out, lse) if return_lse else out


@lazy_jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, page_table_ptr, kv_lens_ptr, cu_q_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_pt, HQ,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, STORE_LSE: tl.constexpr,
    SPLIT_MASK: tl.constexpr, MIN_ROWS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if (tile * BLOCK_M < q_len) & (q_len >= MIN_ROWS):
        kv_len = tl.load(kv_lens_ptr + b)
        offs_r = tl.arange(0, BLOCK_M * G_PAD)
        i = tile * BLOCK_M + offs_r // G_PAD
        hh = offs_r % G_PAD
        row_ok = (i < q_len) & (hh < GROUP)
        pos = kv_len - q_len + i
        hq = kvh * GROUP + hh
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + i)[:, None] * stride_qt + hq[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * G_PAD], tl.float32)
        acc = tl.zeros([BLOCK_M * G_PAD, BLOCK_D], tl.float32)
        kv_end = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * BLOCK_M)
        table = page_table_ptr + b * stride_pt
        n_whole = 0
        if SPLIT_MASK:  # blocks wholly at or before the tile's first row: every row sees every key
            n_whole = (kv_len - q_len + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N
            for n0 in range(0, n_whole, BLOCK_N):
                acc, m_i, l_i = causal_paged_block(
                    q, acc, m_i, l_i, n0, kv_len, pos, table, k_ptr, v_ptr, kvh, qk_scale,
                    stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, offs_d, d_ok,
                    PAGE_SIZE, BLOCK_N, DOT_PREC, False)
        for n0 in range(n_whole, kv_end, BLOCK_N):
            acc, m_i, l_i = causal_paged_block(
                q, acc, m_i, l_i, n0, kv_len, pos, table, k_ptr, v_ptr, kvh, qk_scale,
                stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, offs_d, d_ok,
                PAGE_SIZE, BLOCK_N, DOT_PREC, True)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o_ptrs = out_ptr + (q_start + i)[:, None] * stride_ot + hq[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if STORE_LSE:
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")) * 0.6931471805599453
            tl.store(lse_ptr + (q_start + i) * HQ + hq, lse, mask=row_ok)
