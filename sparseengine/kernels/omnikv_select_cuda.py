"""OmniKV's token pick in CUDA (`omnikv_select.cu`), one launch: the contract of
`omnikv_select.omnikv_select_triton` (the same tokens in the same slots, ties to the earlier
token, the same pool rows), with a cluster of CTAs a request meeting through distributed
shared memory instead of a memset and six launches meeting through global atomics.

`omnikv_select_cuda(scores, kv_lens, sink_tokens, budget, recent_tokens, page_table=None,
page_size=0)`: `scores [B, H, L]` or `[B, L]` float32 (tokens contiguous; entries at or past
`kv_lens[b] - recent` never read), `kv_lens [B]` int32 or int64, `page_table [B, P]` int32
-> `(indices [B, K]` int64, `counts [B]` int32`[, rows [B, K]` int32`])`, K = sink + budget +
recent. `takes(scores, page_table)` says whether OmniKV's decode step runs it (`ENGINE`, an
sm_90 GPU with nvcc, float32 scores, rows of at most `max_tokens()`); otherwise the step runs
the Triton kernel. The first call builds the library with nvcc (`nvcc_build`). Without a GPU
it cannot run: its tests are marked `gpu`, with the Triton kernel, the torch path
(`methods.omnikv.pick_tokens`) and the per-request definition as references.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from ._common import check_lens, check_scores, int_arg
from .nvcc_build import load_library, on_device, require, unavailable

SOURCE = Path(__file__).with_name("omnikv_select.cu")
ENGINE = True  # OmniKV's decode step picks with this kernel where `takes` says it can (read at each call)
CLUSTER = 16  # CTAs a request: 8 (portable) or 16 (read at each call)
PDL = True  # launched as a programmatic dependent launch of the kernel before it (read at each call)
TRIGGER = True  # lets the kernel after it, launched with PDL, start at once (read at each call)

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
SIGNATURES = {  # in the order of the source's `extern "C"` declarations (a CPU test holds them together)
    "se_omnikv_select": (_I, [_P, _L, _L, _I, _I, _P, _I, _P, _P, _P, _L, _I, _P] + [_I] * 7 + [_P]),
    "se_omnikv_select_max_chunk": (_I, []),
}
MAX_CHUNK = 49152  # the source's: tokens a CTA holds


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    return load_library(SOURCE, [], "libse_omnikv_select.so", SIGNATURES, "omnikv_select_cuda")


def max_tokens(cluster: int | None = None) -> int:
    """The widest row the kernel takes: `MAX_CHUNK` tokens a CTA."""
    return MAX_CHUNK * (CLUSTER if cluster is None else cluster)


def runs_on(device: torch.device | str) -> bool:
    """Whether OmniKV's decode step picks with this kernel on `device` (rows within
    `max_tokens()`): `ENGINE` on and a GPU it runs on."""
    return (ENGINE and torch.device(device).type == "cuda" and torch.cuda.is_available()
            and unavailable(device) is None)


def takes(scores: torch.Tensor, page_table: torch.Tensor | None = None) -> bool:
    """Whether OmniKV's decode step picks with this kernel from these scores: `runs_on` their
    device, float32 scores of rows within `max_tokens()`, an int32 page table if any."""
    return (scores.dtype == torch.float32 and scores.shape[-1] <= max_tokens()
            and (page_table is None or page_table.dtype == torch.int32) and runs_on(scores.device))


def omnikv_select_cuda(scores, kv_lens, sink_tokens, budget, recent_tokens, *, page_table=None, page_size: int = 0,
                       cluster: int | None = None, pdl: bool | None = None, trigger: bool | None = None):
    """OmniKV's pick (the module's docstring). `cluster`, `pdl`, `trigger`: the launch
    (default `CLUSTER`, `PDL`, `TRIGGER`)."""
    from .omnikv_select import omnikv_select_triton  # its within-the-total path: no kernel

    check_scores(scores, (2, 3), "[B, L] or [B, H, L]")
    if scores.dim() == 2:
        scores = scores[:, None, :]
    B, H, L = scores.shape
    check_lens(kv_lens, B)
    sink, budget, recent = (int_arg(name, v, 0) for name, v in (("sink_tokens", sink_tokens), ("budget", budget),
                                                               ("recent_tokens", recent_tokens)))
    cluster = CLUSTER if cluster is None else cluster
    if cluster not in (8, 16):
        raise ValueError(f"cluster must be 8 or 16, got {cluster}")
    if scores.dtype != torch.float32:
        raise ValueError(f"omnikv_select_cuda takes float32 scores, got {scores.dtype}")
    if kv_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_lens must be int32 or int64, got {kv_lens.dtype}")
    if L > max_tokens(cluster):
        raise ValueError(f"omnikv_select_cuda takes rows of at most {max_tokens(cluster)} tokens, got L={L}")
    with_rows = page_table is not None
    if with_rows:
        if page_table.dim() != 2 or page_table.shape[0] != B or int_arg("page_size", page_size, 1) < 1:
            raise ValueError(f"page_table must be [B={B}, P] with page_size >= 1, got "
                             f"{tuple(page_table.shape)} and {page_size}")
        if page_table.dtype != torch.int32 or page_table.stride(1) != 1:
            raise ValueError(f"page_table must be int32 with its pages contiguous, got {page_table.dtype}")
        if page_table.shape[1] * page_size < L:  # the kernel stages the page entries of every middle token
            raise ValueError(f"page_table must cover the scores' {L} tokens, got {page_table.shape[1]} pages of "
                             f"{page_size}")
    for name, t in (("kv_lens", kv_lens), ("page_table", page_table)):
        if t is not None and t.device != scores.device:
            raise ValueError(f"scores and {name} must share a device, got {scores.device} and {t.device}")
    total = sink + budget + recent
    if L <= total or B == 0:  # no request can hold more than the total
        return omnikv_select_triton(scores, kv_lens, sink, budget, recent, page_table=page_table,
                                    page_size=page_size)
    require(scores.device, "omnikv_select_cuda")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    kv_lens = kv_lens.contiguous()
    device = scores.device
    indices = torch.empty((B, total), dtype=torch.int64, device=device)
    counts = torch.empty((B,), dtype=torch.int32, device=device)
    rows = torch.empty((B, total), dtype=torch.int32, device=device) if with_rows else None
    err = on_device(scores, library().se_omnikv_select, scores.data_ptr(), scores.stride(0), scores.stride(1), H, L,
                    kv_lens.data_ptr(), int(kv_lens.dtype == torch.int64), indices.data_ptr(), counts.data_ptr(),
                    page_table.data_ptr() if with_rows else None, page_table.stride(0) if with_rows else 0,
                    page_size if with_rows else 0, rows.data_ptr() if with_rows else None, B, sink, budget, recent,
                    cluster, int(PDL if pdl is None else pdl), int(TRIGGER if trigger is None else trigger),
                    torch.cuda.current_stream(device).cuda_stream)
    if err:
        raise RuntimeError(f"omnikv_select_cuda's launch failed: error {err} (B={B}, H={H}, L={L}, total={total}, "
                           f"cluster={cluster})")
    return (indices, counts, rows) if with_rows else (indices, counts)
