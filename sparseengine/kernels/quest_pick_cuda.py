"""Quest's page scores and page choice in one CUDA launch (`quest_pick.cu`): the pages and
counts of `quest_select_cuda.quest_select_pages_cuda` over the scores of
`quest_scores_cuda.quest_page_scores_cuda`, bit for bit, with the choice's launch gone: each
CTA scores its run of items, announces the requests it scored, and the first B x Hkv CTAs
then each choose a (request, KV head) row once every CTA scoring that request has announced
it (`quest_pick.cu`'s header).

`quest_pick_cuda(q, kmax, kmin, page_table, kv_lens, page_size, sink_tokens, recent_tokens,
budget, *, k_cache=None, new_slots=None, counters=None)` takes the scores' inputs
(`quest_scores_cuda`) and the choice's (`quest_select_cuda`) and returns `(pages [B, Hkv, K]`
int64, `counts [B, Hkv]` int32`)`, or with `return_scores=True` also the scores `[B, Hkv, P]`
(a view of rows of P rounded up to 4). `counters`: an int32 workspace of at least 2 x B
entries, zero; each launch leaves it zero, so a caller that launches on one stream at a time
(Quest's runtime, in and out of CUDA graphs) keeps one (`workspace`); without it each call
allocates zeros. Two launches that share a workspace must not run at once: a row would wait
for the other launch's counts.

`takes(q, kmax, pages)` says whether Quest's decode step picks with it: `ENGINE` (off by
default: not yet run on a GPU), an sm_90 GPU with nvcc, and shapes both kernels take.
Without a GPU it cannot run: its GPU tests compare it with the two launches it replaces.
`l2_prefetch=` picks the build of the scoring loads (`quest_scores_cuda.BUILD_L2_PREFETCH`
by default: the scores' code and its switch are theirs).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import quest_scores_cuda, quest_select_cuda
from .nvcc_build import load_library, on_device

SOURCE = Path(__file__).with_name("quest_pick.cu")
ENGINE = False  # Quest's decode step picks with this kernel where `takes` says it can (read at each call)
CTAS_PER_SM = 2  # the grid: CTAs an SM, 1 or 2, at most what fits (read at each call)

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
SIGNATURES = {  # in the order of the source's `extern "C"` declarations (a CPU test holds them together)
    "se_quest_pick": (_I, [_P, _L, _L, _P, _P, _P, _L, _P, _I, _P, _P, _L, _L, _L, _P, _I] + [_I] * 5
                      + [_P, _P] + [_I] * 5 + [_P, _I, _I, _P]),
    "se_quest_pick_max_pages": (_I, []),
}


def library(l2_prefetch: int | None = None) -> ctypes.CDLL:
    """The built library whose loads of the bounds ask L2 for `l2_prefetch` bytes around each
    (default `quest_scores_cuda.BUILD_L2_PREFETCH`: the scores' code is theirs, and so is its
    build switch; nvcc, once a build)."""
    return _library(quest_scores_cuda.build_prefetch(l2_prefetch))


@functools.lru_cache(maxsize=None)
def _library(prefetch: int) -> ctypes.CDLL:
    return load_library(SOURCE, quest_scores_cuda.build_flags(prefetch), "libse_quest_pick.so", SIGNATURES,
                        "quest_pick_cuda")


def takes(q: torch.Tensor, kmax: torch.Tensor, pages: int) -> bool:
    """Whether Quest's decode step picks with this kernel: `ENGINE` on, rows of at most
    `quest_select_cuda.max_pages()` pages, inputs the scores' code runs on
    (`quest_scores_cuda.runs`), whatever the two kernels' own `ENGINE` switches say."""
    return ENGINE and pages <= quest_select_cuda.max_pages() and quest_scores_cuda.runs(q, kmax)


def workspace(max_batch: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed counters for launches of up to `max_batch` requests."""
    return torch.zeros(2 * max_batch, dtype=torch.int32, device=device)


def quest_pick_cuda(q, kmax, kmin, page_table, kv_lens, page_size, sink_tokens, recent_tokens, budget, *,
                    k_cache=None, new_slots=None, counters=None, pdl=None, ctas_per_sm=None, l2_prefetch=None,
                    return_scores=False):
    """Quest's page scores and choice in one launch (the module's docstring); `pdl` as
    `quest_scores_cuda.quest_page_scores_cuda`'s; `ctas_per_sm` default `CTAS_PER_SM`;
    `l2_prefetch`: the build (`library`)."""
    from sparseengine.methods.quest import selection_width  # methods.quest imports this package
    from .quest_select import choice_args, top_pages

    ctas = CTAS_PER_SM if ctas_per_sm is None else ctas_per_sm
    if not isinstance(ctas, int) or isinstance(ctas, bool) or ctas not in (1, 2):
        raise ValueError(f"ctas_per_sm must be 1 or 2 (the grid stays within what an SM holds at once), got {ctas!r}")
    launch = quest_scores_cuda.score_launch(q, kmax, kmin, page_table, kv_lens, page_size, k_cache, new_slots, pdl,
                                            "quest_pick_cuda")
    B, hkv, _, P = launch.shape
    scores = quest_scores_cuda.scores_buffer(B, hkv, P, q.device)
    _, _, _, ps, sink, recent, budget = choice_args(scores, launch.kv_lens, page_size, sink_tokens, recent_tokens,
                                                    budget)
    if not 1 <= P <= quest_select_cuda.max_pages():
        raise ValueError(f"quest_pick_cuda takes 1 to {quest_select_cuda.max_pages()} pages a row, got P={P}")
    if counters is None:
        counters = workspace(B, q.device)
    elif (counters.dtype != torch.int32 or counters.dim() != 1 or counters.numel() < 2 * B
          or counters.device != q.device or not counters.is_contiguous()):
        raise ValueError(f"counters must be a contiguous int32 vector of at least 2 x B = {2 * B} entries on "
                         f"{q.device}, got {tuple(counters.shape)} {counters.dtype} on {counters.device}")
    prefetch = quest_scores_cuda.build_prefetch(l2_prefetch)
    quest_scores_cuda.check_device(q.device, "quest_pick_cuda")
    K = min(selection_width(ps, sink, budget, recent), P)
    pages = torch.empty((B, hkv, K), dtype=torch.int64, device=q.device)
    counts = torch.empty((B, hkv), dtype=torch.int32, device=q.device)
    if B:
        err = on_device(q, _library(prefetch).se_quest_pick, *launch.c_args(scores), pages.data_ptr(),
                        counts.data_ptr(), K, -(-sink // ps), recent, sink + budget + recent, top_pages(budget, ps),
                        counters.data_ptr(), ctas, int(launch.pdl), torch.cuda.current_stream(q.device).cuda_stream)
        if err:
            raise RuntimeError(f"quest_pick_cuda's launch failed: error {err} (B={B}, Hq={q.shape[1]}, Hkv={hkv}, "
                               f"P={P}, K={K})")
    return (pages, counts, scores) if return_scores else (pages, counts)
