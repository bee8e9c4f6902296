"""Quest's page scores in CUDA (`quest_scores.cu`): the contract of
`quest.quest_page_scores_triton` (the bound `max over the group's query heads of sum_c
max(q_c M_c, q_c m_c)` for every page of a request, float32, -inf for the pages past a
request's in the 16-page tiles it scores, the tiles wholly past them unwritten; given
`k_cache` and `new_slots`, the decode step's keys folded into their pages' bounds first),
with each CTA reading whole page rows of the bounds (every KV head) and, in the fold path,
its first tiles' bounds loaded before it waits for the qkv linear before it
(`quest_scores.cu`'s header).

`quest_page_scores_cuda(q, kmax, kmin, page_table, kv_lens, page_size, *, k_cache=None,
new_slots=None)`: `q [B, Hq, 128]` bf16 (rows 16-byte aligned), `kmax, kmin [num_pages,
Hkv, 128]` bf16 contiguous, `page_table [B, P]` int32, `kv_lens [B]` int32 or int64,
`new_slots [B]` int32 or int64 -> `scores [B, Hkv, P]` float32 (a view of rows of P rounded
up to 4, which the CUDA choice reads whole as float4: `quest_select_cuda`). Hkv must divide 8 and
Hq / Hkv be at most 8. `takes(q, kmax)` says whether Quest's decode step scores with it
(`ENGINE`, an sm_90 GPU with nvcc, the shapes above); otherwise the step runs the Triton
kernel. Without a GPU it cannot run: its tests are marked `gpu`, with the torch reference
(`quest.quest_page_scores_ref`) and the minmax update (`update_page_minmax_ref`) as oracles.

On since session 49: in alternating Quest b=6 graph-step profiles (s49-1) the step took
7.992 / 7.990 ms with it against 8.011 / 8.004 with the Triton kernel, and 7.932 / 7.937
against 7.953 / 7.943 with the choice's float4 reads on in both (`gpu_session.sh quest_ab`
as at c9728b1; rows in results/quest_cuda_s49_h200.jsonl). Its launches take longer than
the Triton kernel's (1708 us a step against 1539; 59.3 us against 51.9 alone, s49-2): it
wins only by starting before the qkv linear ends. A ring kernel that sent the bounds by
cp.async through 2 or 3 stages of shared memory, one CTA an SM, was slower (s50-1: 60.4-64.1
us a launch; Quest b=6 graph step 8.189-8.218 ms against 7.912-7.915) and was removed (tag
`quest-scores-ring-lost`).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .nvcc_build import load_library, on_device, require, unavailable
from .quest_scores import check_new_keys

SOURCE = Path(__file__).with_name("quest_scores.cu")
ENGINE = True  # Quest's decode step scores with this kernel where `takes` says it can (read at each call)
PDL = True  # with the fold: launched with PDL, its first bounds loaded before the wait (read at each call)
# The grid: CTAs an SM it is sized for (read at each call). 2 fit an SM at once, each taking a contiguous run of
# items; more queue behind them, each a shorter run (at the 128K shape 24 gives every CTA one item, as the Triton
# kernel's 3120 short programs; an A/B in `gpu_session.sh quest_scores_cuda`, not run yet).
CTAS_PER_SM = 2
MAX_CTAS_PER_SM = 64
# The build (read at each call; `quest_scores.cu`'s SE_L2_PREFETCH): 0 plain streaming loads of the bounds; 64, 128
# or 256 the same loads asking L2 to fetch that many bytes around each (256: a page row's whole 256 B from DRAM at
# its first touch). 256 since session 52: Quest's b=3 graph step 0.7% shorter on an H100 (8.170 against 8.226 ms, two
# rounds each, s52-5 in results/README.md; 128: 8.183, CTAS_PER_SM=24: 8.187).
BUILD_L2_PREFETCH = 256
L2_PREFETCH_SIZES = (0, 64, 128, 256)
HEAD_DIM = 128
MAX_GROUP = 8

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
SIGNATURES = {  # in the order of the source's `extern "C"` declarations (a CPU test holds them together)
    "se_quest_scores": (_I, [_P, _L, _L, _P, _P, _P, _L, _P, _I, _P, _P, _L, _L, _L, _P, _I] + [_I] * 7 + [_P]),
    "se_quest_scores_head_dim": (_I, []),
}


def library(l2_prefetch: int | None = None) -> ctypes.CDLL:
    """The built library of the build `l2_prefetch` names (default `BUILD_L2_PREFETCH`;
    nvcc, once a build)."""
    prefetch = BUILD_L2_PREFETCH if l2_prefetch is None else l2_prefetch
    if prefetch not in L2_PREFETCH_SIZES or isinstance(prefetch, bool):
        raise ValueError(f"l2_prefetch must be one of {L2_PREFETCH_SIZES}, got {prefetch!r}")
    return _library(prefetch)


def build_flags(prefetch: int) -> list[str]:
    """nvcc's -D flags for the build `prefetch` names (none for the plain build: its key as before the flag)."""
    return [f"-DSE_L2_PREFETCH={prefetch}"] if prefetch else []


@functools.lru_cache(maxsize=None)
def _library(prefetch: int) -> ctypes.CDLL:
    return load_library(SOURCE, build_flags(prefetch), "libse_quest_scores.so", SIGNATURES, "quest_scores_cuda")


def shape_reason(hq: int, hkv: int, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the kernel does not take these shapes (None: it does)."""
    if head_dim != HEAD_DIM:
        return f"takes head_dim {HEAD_DIM}, got {head_dim}"
    if dtype != torch.bfloat16:
        return f"takes bf16 bounds and queries, got {dtype}"
    if hkv < 1 or 8 % hkv or hq % hkv or not 1 <= hq // hkv <= MAX_GROUP:
        return f"takes Hkv dividing 8 and 1 to {MAX_GROUP} query heads a KV head, got Hq={hq}, Hkv={hkv}"
    return None


def takes(q: torch.Tensor, kmax: torch.Tensor) -> bool:
    """Whether Quest's decode step scores with this kernel: `ENGINE` on, a GPU it runs on,
    shapes it takes (`shape_reason`)."""
    return (ENGINE and q.device.type == "cuda" and q.dtype == kmax.dtype
            and shape_reason(q.shape[1], kmax.shape[1], q.shape[2], q.dtype) is None
            and unavailable(q.device) is None)


@dataclass(frozen=True)
class ScoreLaunch:
    """A scores launch's checked inputs (`score_launch`): the tensors as the kernel reads them
    and the fold's strides."""
    q: torch.Tensor
    kmax: torch.Tensor
    kmin: torch.Tensor
    table: torch.Tensor
    kv_lens: torch.Tensor
    k_cache: torch.Tensor | None  # with new_slots: the fold
    new_slots: torch.Tensor | None
    page_size: int
    pdl: bool

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, Hkv, group, P)."""
        B, hq, _ = self.q.shape
        hkv = self.kmax.shape[1]
        return B, hkv, hq // hkv, self.table.shape[1]

    def c_args(self, scores: torch.Tensor) -> list:
        """The entry point's arguments from q to page_size (`se_quest_scores`'s order)."""
        fold = self.k_cache is not None
        kp, ko, kh = self.k_cache.stride()[:3] if fold else (0, 0, 0)
        return [self.q.data_ptr(), self.q.stride(0), self.q.stride(1), self.kmax.data_ptr(), self.kmin.data_ptr(),
                self.table.data_ptr(), self.table.stride(0), self.kv_lens.data_ptr(),
                int(self.kv_lens.dtype == torch.int64), scores.data_ptr(), self.k_cache.data_ptr() if fold else None,
                kp, ko, kh, self.new_slots.data_ptr() if fold else None,
                int(fold and self.new_slots.dtype == torch.int64), *self.shape, self.page_size]


def score_launch(q, kmax, kmin, page_table, kv_lens, page_size, k_cache, new_slots, pdl, what) -> ScoreLaunch:
    """The inputs checked (errors name `what`) and made as the kernel reads them; `pdl` (None:
    `PDL`) applies with the fold only (`quest_page_scores_cuda`). Not whether the device runs
    it."""
    if q.dim() != 3 or kmax.dim() != 3:
        raise ValueError(f"q must be [B, Hq, d] and kmax [num_pages, Hkv, d], got {tuple(q.shape)} and "
                         f"{tuple(kmax.shape)}")
    B, hq, d = q.shape
    num_pages, hkv, _ = kmax.shape
    reason = shape_reason(hq, hkv, d, q.dtype) or shape_reason(hq, hkv, kmax.shape[2], kmax.dtype)
    if reason:
        raise ValueError(f"{what} {reason}")
    if kmin.shape != kmax.shape or kmin.dtype != kmax.dtype or not (kmax.is_contiguous() and kmin.is_contiguous()):
        raise ValueError(f"kmax and kmin must be contiguous {tuple(kmax.shape)} {kmax.dtype} tensors, got "
                         f"{tuple(kmin.shape)} {kmin.dtype}")
    if page_table.dim() != 2 or page_table.shape[0] != B or page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be an int32 [B={B}, P] tensor, got {tuple(page_table.shape)} "
                         f"{page_table.dtype}")
    if kv_lens.shape != (B,) or kv_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_lens must be an int32 or int64 [B={B}] tensor, got {tuple(kv_lens.shape)} "
                         f"{kv_lens.dtype}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    fold = check_new_keys(k_cache, new_slots, kmax, B, page_size)
    if fold and new_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"new_slots must be int32 or int64, got {new_slots.dtype}")
    if fold and num_pages * page_size >= 2 ** 31:
        raise ValueError(f"the pool's slots must fit in int32, got {num_pages} pages of {page_size}")
    if pdl and not fold:
        raise ValueError("pdl=True needs the fold (k_cache, new_slots): without it the minmax update just before "
                         "writes the bounds the kernel loads before its wait")
    for t in (kmax, kmin, page_table, kv_lens):
        if t.device != q.device:
            raise ValueError(f"every tensor must be on q's device {q.device}, got {t.device}")
    q = _aligned_rows(q, "q", copy=True)
    for name, t in (("kmax", kmax), ("kmin", kmin)):
        _aligned_rows(t, name, copy=False)
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    if fold:
        k_cache = _aligned_rows(k_cache, "k_cache", copy=False)  # the fold reads the step's keys in place
        new_slots = new_slots.contiguous()
    else:
        k_cache = new_slots = None
    return ScoreLaunch(q, kmax, kmin, page_table, kv_lens.contiguous(), k_cache, new_slots, page_size,
                       bool(fold and (PDL if pdl is None else pdl)))


def scores_buffer(B: int, hkv: int, P: int, device) -> torch.Tensor:
    """`[B, Hkv, P]` float32, a view of rows of P rounded up to 4 floats: the kernels' layout
    (`se_quest_scores`), whose rows the CUDA choice reads whole as float4
    (`quest_select_cuda.whole_rows`)."""
    return torch.empty((B, hkv, -(-P // 4) * 4), dtype=torch.float32, device=device)[..., :P]


def quest_page_scores_cuda(q, kmax, kmin, page_table, kv_lens, page_size, *, k_cache=None, new_slots=None, pdl=None,
                           ctas_per_sm=None, l2_prefetch=None):
    """Quest's page scores (the module's docstring). `pdl` (default `PDL`) applies with the
    fold only: the kernel then loads bounds, page table and lengths before it waits for the
    kernel just before it on the stream, which must not write them (in a decode step that is
    the qkv linear; without the fold the minmax update runs just before and writes the
    bounds). `ctas_per_sm` (default `CTAS_PER_SM`, 1 to `MAX_CTAS_PER_SM`): the grid;
    `l2_prefetch` (default `BUILD_L2_PREFETCH`): the build."""
    ctas = CTAS_PER_SM if ctas_per_sm is None else ctas_per_sm
    if not isinstance(ctas, int) or isinstance(ctas, bool) or not 1 <= ctas <= MAX_CTAS_PER_SM:
        raise ValueError(f"ctas_per_sm must be an int from 1 to {MAX_CTAS_PER_SM}, got {ctas!r}")
    launch = score_launch(q, kmax, kmin, page_table, kv_lens, page_size, k_cache, new_slots, pdl,
                          "quest_page_scores_cuda")
    require(q.device, "quest_page_scores_cuda")
    B, hkv, _, P = launch.shape
    scores = scores_buffer(B, hkv, P, q.device)
    if B == 0 or P == 0:
        return scores
    err = on_device(q, library(l2_prefetch).se_quest_scores, *launch.c_args(scores), ctas, int(launch.pdl),
                    torch.cuda.current_stream(q.device).cuda_stream)
    if err:
        raise RuntimeError(f"quest_page_scores_cuda's launch failed: error {err} (B={B}, Hq={q.shape[1]}, Hkv={hkv}, "
                           f"P={P})")
    return scores


def _aligned_rows(x: torch.Tensor, name: str, *, copy: bool) -> torch.Tensor:
    """x, whose head rows the kernel reads as 16-byte vectors: a contiguous last dim, strides
    in whole 8-element (16-byte) steps, a 16-byte aligned start; else a contiguous copy
    (`copy`) or an error."""
    if x.stride(-1) == 1 and not any(s % 8 for s in x.stride()[:-1]) and x.data_ptr() % 16 == 0:
        return x
    if copy:
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh allocation: aligned
        if x.data_ptr() % 16 == 0:
            return x
    raise ValueError(f"{name} must have a contiguous last dim, 16-byte strides and a 16-byte aligned start, got "
                     f"strides {tuple(x.stride())} at {x.data_ptr() % 16} bytes past 16")
