"""Selection math of the sparse KV-cache methods, exactly as METHODS.md defines it.

Pure torch, vectorised over heads and tokens; one layer and one request per call (loops
over layers and requests are the caller's). Shapes:

- ``k``: ``[n, Hkv, d]`` keys as stored (post-RoPE); ``q``: ``[w, Hq, d]`` or ``[Hq, d]``.
- GQA group ``g = Hq // Hkv``: query head ``h`` reads KV head ``h // g``.
- Kept / selected sets come back as a LongTensor ``[Hkv, k]`` sorted ascending per KV head
  (every head keeps the same count, so eviction can compact each head densely, in order),
  or ``[k]`` when one set is shared by all heads (streamingllm, omnikv).

Every method is exact when the prompt fits: ``n <= sink_tokens + budget + recent_tokens``
returns all tokens (all pages for quest).

Ties in a top-k go to the earlier token (a stable descending sort), so results are
deterministic and a plain reference can reproduce them. Scores are computed in float32.
Validation checks shapes and arguments only; it never reads tensor values (no device
sync in the decode path).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sparseengine.kernels._common import int_arg as _int_arg

POOLINGS = ("max", "avg")
OMNIKV_SCORES = ("logits", "probs")


# ----------------------------------------------------------------------------- checks


def _tensor_arg(name: str, t, layout: str, floating: bool = True) -> torch.Tensor:
    ndim = len(layout.split(","))
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if floating != t.is_floating_point() or t.dtype == torch.bool:
        kind = "floating" if floating else "integer"
        raise ValueError(f"{name} must be an {kind} tensor, got dtype {t.dtype}".replace("an f", "a f"))
    return t


def _gqa_group(num_q_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads < 1 or num_q_heads < num_kv_heads or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads Hq={num_q_heads} must be a positive multiple of KV heads "
            f"Hkv={num_kv_heads}"
        )
    return num_q_heads // num_kv_heads


def _same_head_dim(q: torch.Tensor, k: torch.Tensor) -> int:
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q has d={q.shape[-1]}, k has d={k.shape[-1]}")
    return k.shape[-1]


# ---------------------------------------------------------------------------- helpers


def _all_tokens(num_heads: int, n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device).expand(num_heads, n).contiguous()


def _topk_stable(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, ties to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def _sink_topk_tail(middle: torch.Tensor, sink: int, budget: int, tail_start: int, n: int):
    """``[H, k]`` sorted: tokens ``[0, sink)``, the top ``budget`` of ``middle`` (scores of
    tokens ``[sink, tail_start)``), and tokens ``[tail_start, n)``."""
    heads, device = middle.shape[0], middle.device
    top = _topk_stable(middle, min(budget, middle.shape[-1])).sort(dim=-1).values + sink
    head = torch.arange(sink, device=device).expand(heads, sink)
    tail = torch.arange(tail_start, n, device=device).expand(heads, n - tail_start)
    return torch.cat([head, top, tail], dim=-1)


# ----------------------------------------------------------------------- streamingllm


def streaming_keep(n: int, sink_tokens: int, recent_tokens: int, device=None) -> torch.Tensor:
    """Kept tokens ``[k]`` (shared by all heads): the first ``sink_tokens`` and the last
    ``recent_tokens``; all ``n`` while ``n <= sink_tokens + recent_tokens``."""
    n = _int_arg("n", n)
    sink = _int_arg("sink_tokens", sink_tokens)
    recent = _int_arg("recent_tokens", recent_tokens)
    if n <= sink + recent:
        return torch.arange(n, device=device)
    return torch.cat(
        [torch.arange(sink, device=device), torch.arange(n - recent, n, device=device)]
    )


# ----------------------------------------------------------------------------- snapkv


def snapkv_pool(scores: torch.Tensor, kernel: int = 7, pooling: str = "max") -> torch.Tensor:
    """1-D smoothing along the sequence, kernel ``kernel`` (odd), stride 1, padding
    ``kernel // 2``. ``avg`` counts padding as zero (always divides by ``kernel``); for
    ``max`` padding never wins. ``scores`` is ``[H, m]``; returns float32 ``[H, m]``."""
    _tensor_arg("scores", scores, "[H, m]")
    kernel = _int_arg("snapkv_kernel", kernel, minimum=1)
    if kernel % 2 == 0:
        raise ValueError(f"snapkv_kernel must be odd (stride-1 'same' pooling), got {kernel}")
    if pooling not in POOLINGS:
        raise ValueError(f"snapkv_pooling must be one of {POOLINGS}, got {pooling!r}")
    x = scores.float()
    if x.shape[-1] == 0 or kernel == 1:
        return x.clone()
    x = x.unsqueeze(1)  # [H, 1, m]
    if pooling == "max":
        y = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        y = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return y.squeeze(1)


def snapkv_scores_from_colsums(
    col_sums: torch.Tensor, num_kv_heads: int, kernel: int = 7, pooling: str = "max"
) -> torch.Tensor:
    """SnapKV scores from the window's attention column sums ``[Hq, m]`` (sum over window
    rows of the probabilities of prefix tokens ``j < m = n - window``), as an attention
    kernel emits them: average over each KV head's query heads, then pool. ``[Hkv, m]``."""
    _tensor_arg("col_sums", col_sums, "[Hq, m]")
    hq, m = col_sums.shape
    g = _gqa_group(hq, _int_arg("num_kv_heads", num_kv_heads, minimum=1))
    per_kv = col_sums.float().reshape(hq // g, g, m).mean(dim=1)
    return snapkv_pool(per_kv, kernel, pooling)


def snapkv_scores(
    q_window: torch.Tensor, k: torch.Tensor, kernel: int = 7, pooling: str = "max"
) -> torch.Tensor:
    """SnapKV scores ``[Hkv, n - w]`` of the prefix tokens from the last ``w`` queries.

    ``A = softmax(Q_w K^T / sqrt(d))`` per query head, causal inside the window (window
    query i sits at position ``n - w + i``); ``s_j = sum_i A[i, j]`` for ``j < n - w``;
    averaged over the ``g`` query heads of each KV head; smoothed by :func:`snapkv_pool`.
    This is the reference path; the engine should feed kernel column sums to
    :func:`snapkv_scores_from_colsums` instead of recomputing attention.
    """
    _tensor_arg("q_window", q_window, "[w, Hq, d]")
    _tensor_arg("k", k, "[n, Hkv, d]")
    w, hq, _ = q_window.shape
    n, hkv, _ = k.shape
    d = _same_head_dim(q_window, k)
    g = _gqa_group(hq, hkv)
    if not 1 <= w <= n:
        raise ValueError(f"snapkv window w={w} must be in [1, n={n}]")
    q = q_window.float().reshape(w, hkv, g, d)
    logits = torch.einsum("wkgd,nkd->kgwn", q, k.float()) / math.sqrt(d)  # [Hkv, g, w, n]
    q_pos = torch.arange(n - w, n, device=k.device)
    future = torch.arange(n, device=k.device)[None, :] > q_pos[:, None]  # [w, n]
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
    col_sums = probs[..., : n - w].sum(dim=2).reshape(hq, n - w)  # [Hq, n - w]
    return snapkv_scores_from_colsums(col_sums, hkv, kernel, pooling)


def snapkv_keep(
    scores: torch.Tensor,
    n: int,
    window: int,
    sink_tokens: int,
    budget: int,
    recent_tokens: int,
) -> torch.Tensor:
    """Kept tokens ``[Hkv, k]``: sink, the top-``budget`` middle tokens by ``scores``
    (``[Hkv, n - window]``, from :func:`snapkv_scores`), and the last
    ``max(recent_tokens, window)``. All tokens when ``n <= sink + budget + recent``
    (or when sink and that tail already cover the prompt)."""
    _tensor_arg("scores", scores, "[Hkv, n - window]")
    n = _int_arg("n", n)
    window = _int_arg("snapkv_window", window)
    sink = _int_arg("sink_tokens", sink_tokens)
    budget = _int_arg("budget", budget)
    recent = _int_arg("recent_tokens", recent_tokens)
    if window > n:
        raise ValueError(f"snapkv_window={window} exceeds n={n}")
    if scores.shape[1] != n - window:
        raise ValueError(
            f"scores must be [Hkv, n - window] = [*, {n - window}], got {tuple(scores.shape)}"
        )
    tail = max(recent, window)
    if n <= sink + budget + recent or sink + tail >= n:
        return _all_tokens(scores.shape[0], n, scores.device)
    return _sink_topk_tail(scores[:, sink : n - tail], sink, budget, n - tail, n)


# -------------------------------------------------------------------------- pyramidkv


def pyramidkv_budgets(num_layers: int, budget: int, beta: float, n: int, window: int) -> list[int]:
    """Per-layer middle budgets, falling linearly with depth, mean ``B = budget``.

    ``min = B / beta``, ``max = 2B - min``; layer ``l`` keeps
    ``max - l * (max - min) / (L - 1)``, rounded half up. If ``max > n - window`` it is
    clipped to ``n - window`` and ``min = 2B - max``. Uniform ``[B] * L`` when ``n < 2B``,
    when ``L == 1``, and (our reading, see below) when ``n - window < B``: clipping there
    would give ``max < B < min``, a pyramid standing on its head.
    """
    layers = _int_arg("num_layers", num_layers, minimum=1)
    b = _int_arg("budget", budget)
    n = _int_arg("n", n)
    window = _int_arg("snapkv_window", window)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 1:
        raise ValueError(f"pyramidkv_beta must be a number >= 1, got {beta!r}")
    if window > n:
        raise ValueError(f"snapkv_window={window} exceeds n={n}")
    if layers == 1 or n < 2 * b or n - window < b:
        return [b] * layers
    lo = b / beta
    hi = 2 * b - lo
    if hi > n - window:
        hi = n - window
        lo = 2 * b - hi
    step = (hi - lo) / (layers - 1)
    return [int(math.floor(hi - layer * step + 0.5)) for layer in range(layers)]


# -------------------------------------------------------------------------------- h2o


def h2o_accumulate_colsums(acc: torch.Tensor, col_sums: torch.Tensor) -> torch.Tensor:
    """``acc`` ``[Hkv, n_old]`` plus this step's column sums ``[Hq, n]`` (probabilities
    summed over the step's query rows) averaged over each KV head's query heads; tokens
    ``n_old..n-1`` start at zero. Returns ``[Hkv, n]`` (float32 or wider)."""
    _tensor_arg("acc", acc, "[Hkv, n_old]")
    _tensor_arg("col_sums", col_sums, "[Hq, n]")
    hkv, n_old = acc.shape
    hq, n = col_sums.shape
    g = _gqa_group(hq, hkv)
    if n < n_old:
        raise ValueError(f"col_sums cover n={n} tokens, fewer than acc's n_old={n_old}")
    dtype = torch.promote_types(acc.dtype, torch.float32)
    out = col_sums.to(dtype).reshape(hkv, g, n).mean(dim=1)
    out[:, :n_old] += acc.to(dtype)
    return out


def h2o_accumulate(acc: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """H2O score update from attention probabilities ``[rows, Hq, n]`` (see
    :func:`h2o_accumulate_colsums`)."""
    _tensor_arg("probs", probs, "[rows, Hq, n]")
    return h2o_accumulate_colsums(acc, probs.float().sum(dim=0))


def h2o_keep(acc_scores: torch.Tensor, sink_tokens: int, budget: int, recent_tokens: int):
    """Kept tokens ``[Hkv, k]``: sink, the last ``recent_tokens``, and the top-``budget``
    of the others by accumulated score; all while ``n <= sink + budget + recent``.
    Carry scores forward with ``acc_scores.gather(1, kept)``."""
    _tensor_arg("acc_scores", acc_scores, "[Hkv, n]")
    sink = _int_arg("sink_tokens", sink_tokens)
    budget = _int_arg("budget", budget)
    recent = _int_arg("recent_tokens", recent_tokens)
    hkv, n = acc_scores.shape
    if n <= sink + budget + recent:
        return _all_tokens(hkv, n, acc_scores.device)
    return _sink_topk_tail(acc_scores[:, sink : n - recent], sink, budget, n - recent, n)


# ------------------------------------------------------------------------------ quest


def quest_page_minmax(k: torch.Tensor, page_size: int):
    """``(kmax, kmin)``, each ``[P, Hkv, d]``, ``P = ceil(n / page_size)``: per page, KV
    head and channel, the max / min key over the page's tokens (the last page may be
    partial)."""
    _tensor_arg("k", k, "[n, Hkv, d]")
    page_size = _int_arg("quest_page_size", page_size, minimum=1)
    n, hkv, d = k.shape
    pages = -(-n // page_size)
    shape = (pages, page_size, hkv, d)
    pad = (0, 0, 0, 0, 0, pages * page_size - n)
    hi = F.pad(k, pad, value=float("-inf")).view(shape)
    lo = F.pad(k, pad, value=float("inf")).view(shape)
    return hi.amax(dim=1), lo.amin(dim=1)


def quest_page_bounds(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor) -> torch.Tensor:
    """Upper bounds ``[Hkv, P]``: per query head ``U = sum_c max(q_c M_c, q_c m_c)``,
    then the max over each KV head's query heads. Uses
    ``max(q M, q m) = relu(q) M + min(q, 0) m`` (valid since ``M >= m``): two matmuls."""
    _tensor_arg("q", q, "[Hq, d]")
    _tensor_arg("kmax", kmax, "[P, Hkv, d]")
    _tensor_arg("kmin", kmin, "[P, Hkv, d]")
    if kmax.shape != kmin.shape:
        raise ValueError(f"kmax {tuple(kmax.shape)} and kmin {tuple(kmin.shape)} differ")
    hq, d = q.shape
    pages, hkv, _ = kmax.shape
    _same_head_dim(q, kmax)
    g = _gqa_group(hq, hkv)
    qf = q.float().reshape(hkv, g, d)
    pos, neg = qf.clamp(min=0), qf.clamp(max=0)
    u = torch.einsum("kgd,pkd->kgp", pos, kmax.float())
    u = u + torch.einsum("kgd,pkd->kgp", neg, kmin.float())
    return u.amax(dim=1)


def quest_select_pages(
    bounds: torch.Tensor,
    n: int,
    page_size: int,
    sink_tokens: int,
    recent_tokens: int,
    budget: int,
) -> torch.Tensor:
    """Selected pages ``[Hkv, p]``: the pages holding sink and recent tokens plus the top
    ``max(3, budget // page_size)`` of the other pages by bound (all of them if fewer).
    All pages when ``n <= sink + budget + recent``."""
    _tensor_arg("bounds", bounds, "[Hkv, P]")
    n = _int_arg("n", n)
    page_size = _int_arg("quest_page_size", page_size, minimum=1)
    sink = _int_arg("sink_tokens", sink_tokens)
    recent = _int_arg("recent_tokens", recent_tokens)
    budget = _int_arg("budget", budget)
    hkv, pages = bounds.shape
    if pages != -(-n // page_size):
        raise ValueError(
            f"bounds has P={pages} pages; n={n} tokens in pages of {page_size} need "
            f"{-(-n // page_size)}"
        )
    if n <= sink + budget + recent:
        return _all_tokens(hkv, pages, bounds.device)
    sink_pages = -(-sink // page_size)  # pages [0, sink_pages) hold sink tokens
    recent_first = (n - recent) // page_size if recent else pages
    if sink_pages >= recent_first:
        return _all_tokens(hkv, pages, bounds.device)
    top = max(3, budget // page_size)
    return _sink_topk_tail(bounds[:, sink_pages:recent_first], sink_pages, top, recent_first, pages)


def pages_to_tokens(pages: torch.Tensor, page_size: int, n: int):
    """Token indices of selected pages: ``(tokens, valid)``, both ``[Hkv, p * page_size]``.
    ``tokens`` is sorted ascending per head; entries past the prompt (the tail of a
    partial last page) are ``>= n`` and have ``valid = False``."""
    _tensor_arg("pages", pages, "[Hkv, p]", floating=False)
    page_size = _int_arg("quest_page_size", page_size, minimum=1)
    n = _int_arg("n", n)
    offsets = torch.arange(page_size, device=pages.device)
    tokens = (pages.long()[..., None] * page_size + offsets).flatten(-2)
    return tokens, tokens < n


# ----------------------------------------------------------------------------- omnikv


def omnikv_token_scores(q: torch.Tensor, k: torch.Tensor, mode: str = "logits") -> torch.Tensor:
    """Token scores ``[n]``: the max over ALL query heads of ``q . k / sqrt(d)``
    (``logits``) or of its softmax over the tokens (``probs``)."""
    _tensor_arg("q", q, "[Hq, d]")
    _tensor_arg("k", k, "[n, Hkv, d]")
    if mode not in OMNIKV_SCORES:
        raise ValueError(f"omnikv_score must be one of {OMNIKV_SCORES}, got {mode!r}")
    hq, d = q.shape
    n, hkv, _ = k.shape
    _same_head_dim(q, k)
    g = _gqa_group(hq, hkv)
    logits = torch.einsum("kgd,nkd->kgn", q.float().reshape(hkv, g, d), k.float()) / math.sqrt(d)
    if mode == "probs":
        logits = torch.softmax(logits, dim=-1)
    return logits.reshape(hq, n).amax(dim=0)


def omnikv_select(scores: torch.Tensor, sink_tokens: int, budget: int, recent_tokens: int):
    """One index set ``[k]`` shared by all heads: sink, top-``budget`` middle tokens by
    ``scores`` ``[n]``, last ``recent_tokens``; all while ``n <= sink + budget + recent``."""
    _tensor_arg("scores", scores, "[n]")
    sink = _int_arg("sink_tokens", sink_tokens)
    budget = _int_arg("budget", budget)
    recent = _int_arg("recent_tokens", recent_tokens)
    n = scores.shape[0]
    if n <= sink + budget + recent:
        return torch.arange(n, device=scores.device)
    return _sink_topk_tail(scores[None, sink : n - recent], sink, budget, n - recent, n)[0]
