"""Quest's page selection in CUDA (`quest_select.cu`): the contract of
`quest_select.quest_select_pages_triton` (the same pages in the same slots, ties to the
earlier page), with the bound's search in one warp and the pick by ranks (a thread a
candidate) instead of chains of block-wide reductions.

`quest_select_pages_cuda(scores, kv_lens, page_size, sink_tokens, recent_tokens, budget)`:
`scores [B, Hkv, P]` float32 (pages contiguous; entries past a request's pages never read),
`kv_lens [B]` int32 or int64 -> `(pages [B, Hkv, K]` int64, `counts [B, Hkv]` int32`)`.
`takes(device, pages)` says whether Quest's decode step runs it (`ENGINE`, an sm_90 GPU with
nvcc, at most `max_pages()` pages a row); otherwise the step runs the Triton kernel.
The first call builds the library with nvcc (`nvcc_build`). Without a GPU it cannot run: its
tests are marked `gpu`, and the torch path (`methods.quest.select_pages_batched`) and the
per-request definition are their references.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .nvcc_build import load_library, on_device, require, unavailable

SOURCE = Path(__file__).with_name("quest_select.cu")
ENGINE = True  # Quest's decode step selects with this kernel where `takes` says it can (read at each call)
PDL = False  # launched as a programmatic dependent launch of the page scores (read at each call)
# Rows read as float4 through shared memory where each row's storage holds P rounded up to 4 floats (16-byte aligned:
# `whole_rows`; the CUDA scores' rows do, the engine's 8321-page table included), read at each call. Before session 51
# it took rows of a multiple of 4 pages only, so the engine's choice at the 128K shape (8321 pages) never took it.
VEC = True

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
SIGNATURES = {  # in the order of the source's `extern "C"` declarations (a CPU test holds them together)
    "se_quest_select": (_I, [_P, _L, _L, _P, _I, _P, _P] + [_I] * 11 + [_P]),
    "se_quest_select_max_pages": (_I, []),
}


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    return load_library(SOURCE, [], "libse_quest_select.so", SIGNATURES, "quest_select_cuda")


def max_pages() -> int:
    """The widest row the kernel takes (256 threads x 64 keys)."""
    return 256 * 64


def takes(device: torch.device | str, pages: int) -> bool:
    """Whether Quest's decode step selects with this kernel on `device` for rows of `pages`
    pages: `ENGINE` on, a GPU it runs on, `pages <= max_pages()` (the page scores are float32)."""
    return ENGINE and torch.device(device).type == "cuda" and pages <= max_pages() and unavailable(device) is None


def whole_rows(scores: torch.Tensor) -> bool:
    """Whether every row of `scores [B, H, P]` (pages contiguous) may be read as float4 up to
    P rounded up to 4: rows 16 bytes apart and aligned, the last one's floats within the
    storage (past P they are another row's or padding, never taken)."""
    B, H, P = scores.shape
    if scores.stride(-1) != 1 or scores.data_ptr() % 16 or any(s % 4 for s in scores.stride()[:2]):
        return False
    last = scores.storage_offset() + (B - 1) * scores.stride(0) + (H - 1) * scores.stride(1)
    return last + -(-P // 4) * 4 <= scores.untyped_storage().nbytes() // scores.element_size()


def quest_select_pages_cuda(scores, kv_lens, page_size, sink_tokens, recent_tokens, budget, *, pdl=None):
    """Quest's choice per (request, KV head) (the module's docstring); `pdl`: a programmatic
    dependent launch (default `PDL`)."""
    from sparseengine.methods.quest import selection_width  # methods.quest imports this package
    from .quest_select import choice_args, top_pages

    B, H, P, ps, sink, recent, budget = choice_args(scores, kv_lens, page_size, sink_tokens, recent_tokens, budget)
    if scores.dtype != torch.float32:
        raise ValueError(f"quest_select_pages_cuda takes float32 scores, got {scores.dtype}")
    if not 1 <= P <= max_pages():
        raise ValueError(f"quest_select_pages_cuda takes 1 to {max_pages()} pages a row, got P={P}")
    if kv_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_lens must be int32 or int64, got {kv_lens.dtype}")
    if kv_lens.device != scores.device:
        raise ValueError(f"scores and kv_lens must share a device, got {scores.device} and {kv_lens.device}")
    require(scores.device, "quest_select_pages_cuda")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    kv_lens = kv_lens.contiguous()
    K = min(selection_width(ps, sink, budget, recent), P)
    pages = torch.empty((B, H, K), dtype=torch.int64, device=scores.device)
    counts = torch.empty((B, H), dtype=torch.int32, device=scores.device)
    if B * H == 0:
        return pages, counts
    err = on_device(scores, library().se_quest_select, scores.data_ptr(), scores.stride(0), scores.stride(1),
                    kv_lens.data_ptr(), int(kv_lens.dtype == torch.int64), pages.data_ptr(), counts.data_ptr(), B, H,
                    P, K, ps, -(-sink // ps), recent, sink + budget + recent, top_pages(budget, ps),
                    int(PDL if pdl is None else pdl), int(VEC and whole_rows(scores)),
                    torch.cuda.current_stream(scores.device).cuda_stream)
    if err:
        raise RuntimeError(f"quest_select_pages_cuda's launch failed: error {err} (B={B}, Hkv={H}, P={P}, K={K})")
    return pages, counts
