"""Decode attention over a selection of the paged cache in CUDA (`sparse_attention.cu`): the
contract of `sparse_decode.py`'s page variant (Quest's chosen pages) and rows variant
(OmniKV's pool rows), in one launch where the Triton path takes a split kernel and a merge.

`sparse_page_decode_cuda(q, k_cache, v_cache, page_table, kv_lens, page_indices,
num_pages_selected, scale=None, return_lse=False)` and `sparse_rows_decode_cuda(q, k_cache,
v_cache, rows, num_selected, scale=None, return_lse=False)` take what their `*_triton` twins
take, restricted to: bf16 q and cache, head dim 128, at most 8 query heads a KV head, a
contiguous cache, pages of 16 tokens for the page variant, and `page_table` int32. Each
returns `out [B, Hq, 128]` bf16 (and `lse [B, Hq]` float32, natural log; -inf and a zero
output for a row with nothing attended).

`takes(q, k_cache, entries, pages)` says whether the decode step attends with it (`ENGINE`, off
by default since session 56: the step was slower with it on an H200, the comment at `ENGINE`;
an sm_90 GPU with nvcc, the shapes above, a row's chunks within what `splits` CTAs take);
otherwise the step runs the Triton kernels. The first call builds the library with nvcc
(`nvcc_build`). Without a GPU it cannot run: its tests are marked `gpu`, with
`sparse_page_decode_ref` / `sparse_rows_decode_ref` as the oracles.
"""
from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from . import _common
from .nvcc_build import load_library, on_device, require, unavailable
from .sparse_decode import _check_selection

SOURCE = Path(__file__).with_name("sparse_attention.cu")
# The decode step attends over Quest's pages and OmniKV's rows with it where `takes` says (read at each call). Off:
# a launch alone is faster (H200, 128K shape, b=6, in a CUDA graph of 30: 16.8 us against 21.5 for the Triton split
# kernel and merge), but the b=6 graph step is slower with it (two rounds, alternating, s56-8: Quest 7.957 / 7.967 ms
# against 7.918 / 7.906, OmniKV 8.403 / 8.410 against 8.345 / 8.340). In the step's timeline (s56-7) it takes 19.9 us
# start to next against 19.5 + 2.0 for the two Triton launches, and without the merge kernel's PDL signal the o
# projection no longer starts early. H100, b=3 (s56-4): Quest 7.891 against 7.927 ms, OmniKV 8.320 against 8.314.
ENGINE = False
# The kernel lets the o projection (a PDL launch) start at once, as the Triton merge does (read at each call). Off:
# with it on, the o projection's persistent CTAs (one an SM) were placed as this kernel's CTAs left the SMs, unevenly,
# and every linear of the layer after it ran slower (H100, Quest b=3 graph step 8.828 ms against 7.93 for the Triton
# launches: o 29.4 us against 14.9, down 104 against 56; s56-1; H200, b=6, s56-8: Quest 9.37 ms against 7.96).
TRIGGER = False
# The build (read at each call; `sparse_attention.cu`'s SE_STAGES): chunks of K and V a warp keeps in flight. A
# CTA takes 4 x stages x 8.5 KB of shared memory (+ 4 KB, rows variant): 3 CTAs fit an SM at 2 stages, 2 at 3, 1 at 4.
BUILD_STAGES = 2
STAGE_CHOICES = (2, 3, 4)
# The grid's size: rows x splits about this many CTAs an SM (None: as many as fit at once; read at each call).
CTAS_PER_SM: int | None = None
# At most this many CTAs a row by default (read at each call). H100, 128K shape, 129 pages a row, per launch in a
# graph (s56-1, results/sparse_attention_s56_h100.jsonl): b=6 22.8 us at 4 CTAs a row against 29.2 at 8 (clusters
# of 8 at 3 CTAs an SM do not all fit a GPC at once) and 25.6 for the Triton launches; b=3 11.6 against 12.1.
# H200, b=6 (s56-7): 16.8 us at 4, 17.9 at 6, 24.1 at 8, 18.6 at 3; the Triton launches 21.5.
SPLITS_CAP = 4
HEAD_DIM = 128
CHUNK = 16  # tokens a chunk: a page (the page variant's page size) or 16 entries
MAX_GROUP = 8
MAX_SPLITS = 8  # CTAs a (request, KV head) row: one cluster
MAX_CHUNKS_PER_SPLIT = 4 * 16  # 4 warps, each at most 16 chunks
MAX_ROWS = 65535  # B x Hkv: the grid's y

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
SIGNATURES = {  # in the order of the source's `extern "C"` declarations (a CPU test holds them together)
    "se_sparse_attention": (_I, [_P, _L, _L, _P, _P, _P, _L, _L, _I, _P, _L, _L, _I, _P, _L, _P, _I, _P, _L, _L, _P]
                            + [_I] * 6 + [_F, _I, _P]),
    "se_sparse_attention_max_chunks": (_I, [_I]),
}


def library(stages: int | None = None) -> ctypes.CDLL:
    """The built library of the build `stages` names (default `BUILD_STAGES`; nvcc, once a build)."""
    stages = BUILD_STAGES if stages is None else stages
    if stages not in STAGE_CHOICES or isinstance(stages, bool):
        raise ValueError(f"stages must be one of {STAGE_CHOICES}, got {stages!r}")
    return _library(stages)


def build_flags(stages: int) -> list[str]:
    """nvcc's -D flags for the build of `stages` (none for the default 2)."""
    return [] if stages == 2 else [f"-DSE_STAGES={stages}"]


@functools.lru_cache(maxsize=None)
def _library(stages: int) -> ctypes.CDLL:
    return load_library(SOURCE, build_flags(stages), "libse_sparse_attention.so", SIGNATURES, "sparse_attention_cuda")


def ctas_fit(stages: int) -> int:
    """CTAs of the `stages` build that fit an SM at once (227 KB of shared memory, 1 KB a CTA reserved)."""
    return 227 * 1024 // (4 * stages * 2 * CHUNK * (2 * HEAD_DIM + 16) + 4096 + 1024)


def chunks_of(entries: int, pages: bool) -> int:
    """A row's chunks of 16 tokens: one a page, or one per 16 entries."""
    return entries if pages else -(-entries // CHUNK)


def splits_for(rows: int, chunks: int, num_sms: int, ctas_per_sm: int | None = None,
               cap: int | None = None) -> int | None:
    """CTAs a row: at most `ctas_per_sm` CTAs an SM over the grid (default: what fit at once), at most `cap`
    (default `SPLITS_CAP`), no more than keep every warp a chunk, at least what the row's
    chunks need (64 a CTA; that may pass the cap); None when they need more than `MAX_SPLITS`."""
    need = -(-chunks // MAX_CHUNKS_PER_SPLIT)
    if need > MAX_SPLITS:
        return None
    if ctas_per_sm is None:
        ctas_per_sm = CTAS_PER_SM if CTAS_PER_SM is not None else ctas_fit(BUILD_STAGES)
    fill = ctas_per_sm * num_sms // max(rows, 1)  # whole waves: no CTA waits for another's SM
    return max(need, min(fill, SPLITS_CAP if cap is None else cap, -(-chunks // 4)), 1)


def shape_reason(q: torch.Tensor, k_cache: torch.Tensor, entries: int, pages: bool) -> str | None:
    """Why the kernel cannot take a selection of `entries` a row (pages, or pool rows) over
    `k_cache` for `q` (None: it can): what `takes` asks and the wrappers raise."""
    if q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16:
        return f"takes bf16 q and cache, got {q.dtype} and {k_cache.dtype}"
    if q.dim() != 3 or k_cache.dim() != 4 or q.shape[-1] != HEAD_DIM or k_cache.shape[-1] != HEAD_DIM:
        return f"takes head dim {HEAD_DIM}, got q {tuple(q.shape)} and cache {tuple(k_cache.shape)}"
    B, Hq, Hkv = q.shape[0], q.shape[1], k_cache.shape[2]
    if Hq % Hkv or Hq // Hkv > MAX_GROUP:
        return f"takes at most {MAX_GROUP} query heads a KV head (Hq a multiple of Hkv), got Hq={Hq}, Hkv={Hkv}"
    if not k_cache.is_contiguous():
        return "takes a contiguous cache"
    if pages and k_cache.shape[1] != CHUNK:
        return f"takes pages of {CHUNK} tokens, got {k_cache.shape[1]}"
    if B * Hkv > MAX_ROWS:
        return f"takes B x Hkv up to {MAX_ROWS}, got {B * Hkv}"
    if not 1 <= chunks_of(entries, pages) <= MAX_SPLITS * MAX_CHUNKS_PER_SPLIT:
        return (f"takes 1 to {MAX_SPLITS * MAX_CHUNKS_PER_SPLIT} chunks of {CHUNK} a row, got "
                f"{chunks_of(entries, pages)}")
    return None


def takes(q: torch.Tensor, k_cache: torch.Tensor, entries: int, pages: bool) -> bool:
    """Whether the decode step attends over a selection of `entries` a row (pages, or pool
    rows) with this kernel: `ENGINE` on, a GPU it runs on, and the shapes it takes."""
    return (ENGINE and q.device.type == "cuda" and shape_reason(q, k_cache, entries, pages) is None
            and unavailable(q.device) is None)


def _check(q, k_cache, v_cache, sel, num_sel, pages):
    reason = shape_reason(q, k_cache, sel.shape[-1], pages)
    if reason is not None:
        raise ValueError(f"the CUDA sparse attention {reason}")
    if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape or not v_cache.is_contiguous():
        raise ValueError("k_cache and v_cache must be contiguous and of one shape and dtype")
    if q.stride(-1) != 1 or q.stride(0) % 2 or q.stride(1) % 2 or q.data_ptr() % 4:
        raise ValueError("q's channels must be contiguous, its rows and heads 4-byte aligned")
    _check_selection(q, k_cache, sel, num_sel)
    for t in (k_cache, v_cache, sel, num_sel):
        if t.device != q.device:
            raise ValueError(f"every tensor must be on q's device {q.device}, got {t.device}")


def _launch(pages, q, k_cache, v_cache, sel, num_sel, page_table, kv_lens, scale, return_lse, splits, trigger,
            stages):
    require(q.device, "the CUDA sparse attention")  # after every check of the input
    B, Hq, _ = q.shape
    Hkv = k_cache.shape[2]
    K = sel.shape[2]
    chunks = chunks_of(K, pages)
    stages = BUILD_STAGES if stages is None else stages
    lib = library(stages)
    if splits is None:  # shape_reason checked that the chunks fit MAX_SPLITS CTAs
        splits = splits_for(B * Hkv, chunks, _common.num_sms(q.device),
                            CTAS_PER_SM if CTAS_PER_SM is not None else ctas_fit(stages))
    elif not 1 <= splits <= MAX_SPLITS or chunks > splits * MAX_CHUNKS_PER_SPLIT:
        raise ValueError(f"splits must be 1 to {MAX_SPLITS} and take the row's {chunks} chunks (at most "
                         f"{MAX_CHUNKS_PER_SPLIT} each), got {splits}")
    out = _common.empty((B, Hq, HEAD_DIM), q.dtype, q.device)  # every entry written (tests poison these)
    lse = _common.empty((B, Hq), torch.float32, q.device) if return_lse else None
    scale = _common.default_scale(HEAD_DIM, scale)
    if B:
        err = on_device(q, lib.se_sparse_attention, q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(),
                        v_cache.data_ptr(), sel.data_ptr(), sel.stride(0), sel.stride(1),
                        int(sel.dtype == torch.int64), num_sel.data_ptr(), num_sel.stride(0),
                        num_sel.stride(1), int(num_sel.dtype == torch.int64),
                        page_table.data_ptr() if pages else None, page_table.stride(0) if pages else 0,
                        kv_lens.data_ptr() if pages else None, int(pages and kv_lens.dtype == torch.int64),
                        out.data_ptr(), out.stride(0), out.stride(1), lse.data_ptr() if return_lse else None, B, Hkv,
                        Hq // Hkv, K, int(pages), splits, scale * math.log2(math.e),
                        int(TRIGGER if trigger is None else trigger), torch.cuda.current_stream(q.device).cuda_stream)
        if err:
            raise RuntimeError(f"the CUDA sparse attention's launch failed: error {err} (B={B}, Hkv={Hkv}, K={K}, "
                               f"splits={splits})")
    return (out, lse) if return_lse else out


def sparse_page_decode_cuda(q, k_cache, v_cache, page_table, kv_lens, page_indices, num_pages_selected, scale=None,
                            return_lse=False, *, splits=None, trigger=None, stages=None):
    """`sparse_page_decode_ref`'s attention (the module's docstring); `splits`: CTAs a row
    (default `splits_for`), `trigger`: the PDL signal at the start (default `TRIGGER`),
    `stages`: the build (default `BUILD_STAGES`)."""
    _check(q, k_cache, v_cache, page_indices, num_pages_selected, pages=True)
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.stride(1) != 1:
        raise ValueError(f"page_table must be [B, pages] int32 with pages contiguous, got {page_table.dtype} "
                         f"{tuple(page_table.shape)}")
    if kv_lens.dtype not in (torch.int32, torch.int64) or kv_lens.shape != (q.shape[0],):
        raise ValueError(f"kv_lens must be [B] int32 or int64, got {kv_lens.dtype} {tuple(kv_lens.shape)}")
    if page_table.device != q.device or kv_lens.device != q.device:
        raise ValueError(f"page_table and kv_lens must be on q's device {q.device}")
    return _launch(True, q, k_cache, v_cache, page_indices, num_pages_selected, page_table, kv_lens.contiguous(),
                   scale, return_lse, splits, trigger, stages)


def sparse_rows_decode_cuda(q, k_cache, v_cache, rows, num_selected, scale=None, return_lse=False, *, splits=None,
                            trigger=None, stages=None):
    """`sparse_rows_decode_ref`'s attention (the module's docstring); `splits`, `trigger`, `stages` as
    `sparse_page_decode_cuda`'s. The rows must name pool rows below 2**31."""
    _check(q, k_cache, v_cache, rows, num_selected, pages=False)
    if k_cache.shape[0] * k_cache.shape[1] >= 2**31:
        raise ValueError(f"the CUDA rows attention takes pools of under 2**31 rows, got {k_cache.shape[:2]}")
    return _launch(False, q, k_cache, v_cache, rows, num_selected, None, None, scale, return_lse, splits, trigger,
                   stages)
