"""Per-step attention metadata: one object the runner fills before each forward.

Typed, frozen views at the boundary between cache state and attention:
- ``LayerView``: where this layer writes and what each request holds in its cache.
- ``Selection``: the cache tokens each (request, KV head) may read, chosen by a method.
- ``ScoreRows``: how many of each request's last query rows must report the attention
  probability mass every cached token received (column sums), from the attention the
  step computes anyway.
- ``BlockMask``: block-sparse causal attention for prefill rows: which key blocks each
  query block of each query head computes.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sparseengine.engine.sequence import Sequence


@dataclass(frozen=True)
class LayerView:
    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token
    kv_lens: torch.Tensor  # [B] int32 tokens in the cache after this step's writes
    kv_lens_list: tuple[int, ...]  # the same on the host
    page_table: torch.Tensor  # [B, max_pages] int32


@dataclass(frozen=True)
class Selection:
    """Per request and KV head, the logical cache indices a decode query may read.
    ``token_indices [B, Hkv, K]`` int64; entries at or past ``num_selected [B, Hkv]`` are
    ignored. Requests with ``dense[b]`` True (prefill rows in a mixed batch, or layers the
    method leaves dense) read their whole cache.

    ``page_size`` 0: the entries are logical token indices. ``page_size`` > 0 (it equals
    the KV cache's page size): they are logical page indices and ``num_selected`` counts
    pages; page p stands for tokens ``[p * page_size, (p + 1) * page_size)`` below the
    request's cache length.

    ``pool_rows`` (token entries only; optional): the same entries as rows of the paged
    cache, ``page_table[b, t // ps] * ps + t % ps`` (-1 where an entry does not count), as
    OmniKV's pick writes them once for the layers up to its next filter layer; every layer
    keeps a request's pages under its one page table, so the rows hold in each. A provider
    may read them instead of looking each token up (the Triton one does); the tokens
    stay the definition."""

    token_indices: torch.Tensor
    num_selected: torch.Tensor
    dense: tuple[bool, ...]
    page_size: int = 0
    pool_rows: torch.Tensor | None = None

    def request_tokens(self, b: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request b's selected logical tokens ``[Hkv, W]`` and which entries count (within
        ``num_selected`` and below ``kv_len``); entries that do not count hold 0."""
        idx, count = self.token_indices[b], self.num_selected[b]
        valid = torch.arange(idx.shape[-1], device=idx.device)[None, :] < count[:, None]
        if self.page_size:
            offsets = torch.arange(self.page_size, device=idx.device)
            idx = (idx[..., None] * self.page_size + offsets).flatten(-2)
            valid = valid.repeat_interleave(self.page_size, dim=-1)
        valid = valid & (idx >= 0) & (idx < kv_len)
        return torch.where(valid, idx, 0), valid

    def take(self, requests, index: torch.Tensor | None = None) -> "Selection":
        """The selection of the listed requests only, in that order (their rows of every
        tensor; one gather each). ``index``: the same requests as a device tensor, where the
        caller has one (``RequestGroup.reqs``)."""
        requests = list(requests)
        if not requests:
            raise ValueError("Selection.take needs at least one request")
        bad = [b for b in requests if not 0 <= b < len(self.dense)]
        if bad:
            raise ValueError(f"Selection.take: requests {bad} out of range for a selection of {len(self.dense)}")
        idx = torch.tensor(requests, device=self.token_indices.device) if index is None else index
        rows = None if self.pool_rows is None else self.pool_rows.index_select(0, idx)
        return Selection(self.token_indices.index_select(0, idx), self.num_selected.index_select(0, idx),
                         tuple(self.dense[b] for b in requests), self.page_size, rows)

    @staticmethod
    def from_lists(per_request: list[torch.Tensor | None], num_kv_heads: int, device,
                   counts: list[torch.Tensor | None] | None = None) -> "Selection":
        """Build from one ``[Hkv, k_b]`` (or ``[k_b]``, shared by heads) index tensor per
        request, or None for a dense request. ``counts[b]`` ``[Hkv]``: how many leading
        entries of each head are valid (default: all)."""
        width = max([t.shape[-1] for t in per_request if t is not None] or [1])
        idx = torch.zeros(len(per_request), num_kv_heads, width, dtype=torch.long, device=device)
        count = torch.zeros(len(per_request), num_kv_heads, dtype=torch.int32, device=device)
        for b, t in enumerate(per_request):
            if t is None:
                continue
            t = t.expand(num_kv_heads, -1) if t.dim() == 1 else t
            idx[b, :, : t.shape[-1]] = t
            count[b] = t.shape[-1] if counts is None or counts[b] is None else counts[b]
        return Selection(idx, count, tuple(t is None for t in per_request))


@dataclass(frozen=True)
class ScoreRows:
    """rows[b]: report per-token scores over the last rows[b] query rows of request b.

    ``kind`` "colsum": the attention probability each cached token received (column
    sums), averaged over the query heads of its KV head. The provider returns them as one
    ``[Hkv, kv_len]`` tensor per request; with ``max_kv_len`` set (decode steps only, a
    bound on every row's cache length) as one ``[B, Hkv, max_kv_len]`` tensor, zero past
    each row's length: a static shape, so a CUDA graph can capture the step.

    ``kind`` "max_logits" (decode steps only, ``max_kv_len`` required): the max over query
    heads of the scaled logit ``q . k / sqrt(d)`` of every cached token, per KV head
    (``[B, Hkv, max_kv_len]`` fp32) or already over all query heads (``[B, 1, max_kv_len]``,
    the Triton provider's by default): consumers take the max over dim 1. Past each row's
    length the values are unspecified (-inf, or unwritten where the provider saves the
    fill): consumers read each row's tokens only. The decode attention emits them while it
    reads K anyway (OmniKV's filter-layer scores)."""

    rows: tuple[int, ...]
    max_kv_len: int | None = None
    kind: str = "colsum"

    def __post_init__(self) -> None:
        if self.kind not in SCORE_KINDS:
            raise ValueError(f"ScoreRows.kind must be one of {SCORE_KINDS}, got {self.kind!r}")
        if self.kind == "max_logits" and self.max_kv_len is None:
            raise ValueError("ScoreRows(kind='max_logits') needs max_kv_len (one padded [B, G, max_kv_len] tensor)")


SCORE_KINDS = ("colsum", "max_logits")


@dataclass(frozen=True)
class BlockMask:
    """Block-sparse causal attention for the prefill rows of a step.

    The cache index space is cut into blocks of ``block_size`` (block j holds cache indices
    ``[j * block_size, (j + 1) * block_size)``). Request b's ``q_len`` rows sit at cache
    indices ``kv_len - q_len .. kv_len - 1``; its first query block is
    ``f = (kv_len - q_len) // block_size``. ``masks[b]`` is a bool tensor
    ``[Hq, (kv_len - 1) // block_size - f + 1, ceil(kv_len / block_size)]``: the row at
    cache index p of query head h reads key t iff ``t <= p`` and (``t // block_size ==
    p // block_size``, the diagonal block, always computed, or
    ``masks[b][h, p // block_size - f, t // block_size]``). ``masks[b]`` None: dense causal
    (decode rows, short prompts). With every entry True it is exactly dense causal."""

    block_size: int
    masks: tuple[torch.Tensor | None, ...]

    def token_mask(self, b: int, q_len: int, kv_len: int) -> torch.Tensor | None:
        """``[Hq, q_len, kv_len]`` bool: the cached tokens each of request b's rows reads
        (causal rule included), or None for a dense request."""
        m = self.masks[b]
        if m is None:
            return None
        bs, first = self.block_size, (kv_len - q_len) // self.block_size
        n_q, n_k = (kv_len - 1) // bs - first + 1, -(-kv_len // bs)
        if m.dim() != 3 or tuple(m.shape[1:]) != (n_q, n_k):
            raise ValueError(f"BlockMask.masks[{b}] must be [Hq, {n_q}, {n_k}] for q_len={q_len}, "
                             f"kv_len={kv_len}, block_size={bs}; got {tuple(m.shape)}")
        pos = torch.arange(kv_len - q_len, kv_len, device=m.device)
        keys = torch.arange(kv_len, device=m.device)
        qb, kb = pos // bs, keys // bs
        allowed = m[:, (qb - first)[:, None], kb[None, :]] | (qb[:, None] == kb[None, :])
        return allowed & (keys[None, :] <= pos[:, None])


@dataclass(frozen=True)
class RequestGroup:
    """Some of a step's requests, in the order listed, as one sub-step: ``reqs`` [n] int64
    their indices and ``rows`` [their query rows] int64 their rows of the step's packed q,
    on the step's device; ``step`` a StepContext of those requests alone (its ``views``
    empty and ``positions`` those rows': a provider takes the view it attends over as an
    argument, cut by ``view``). Made once a step by ``StepContext.group``, so the layers
    of a step share the index tensors and the cut views (a provider's plan per view)."""

    requests: tuple[int, ...]
    reqs: torch.Tensor
    rows: torch.Tensor
    step: "StepContext"
    _views: dict = field(default_factory=dict, repr=False, compare=False)

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """These requests' rows of a tensor packed by the step's query rows (``q``, an
        output): one gather (``index_select``; on the CPU it took about half the host time
        of tensor indexing, the change measured in session 37)."""
        return x.index_select(0, self.rows)

    def put_rows(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Write ``x`` (these requests' rows, in order) into ``out``'s rows of them."""
        return out.index_copy_(0, self.rows, x)

    def view(self, view: LayerView) -> LayerView:
        """``view`` cut to these requests, for reading (no slots: the step's K/V are written
        before attention), the same object for the same view all step."""
        held = self._views.get(id(view))
        if held is None:
            cut = LayerView(view.slot_mapping[:0], view.kv_lens.index_select(0, self.reqs),
                            tuple(view.kv_lens_list[b] for b in self.requests),
                            view.page_table.index_select(0, self.reqs))
            held = self._views[id(view)] = (view, cut)  # the view is held: its id stays unique this step
        return held[1]


@dataclass
class StepContext:
    seqs: list["Sequence"]
    q_lens: tuple[int, ...]
    cu_q_lens: torch.Tensor  # [B+1] int32
    is_decode: bool  # every request feeds exactly one token
    views: list[LayerView]  # one per layer (shared objects when layers agree)
    kv_cache: Any  # sparseengine.engine.kv_cache.KVCache
    provider: Any  # an AttentionProvider
    method: Any  # a SparseMethodRuntime
    positions: torch.Tensor  # [T]
    # a decode CUDA graph's context (capture and its warm-up runs): the graph's id, the one
    # ``AttentionProvider.plan_graph_step`` was given; None for an eager step
    graph: Any = None
    _groups: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    def group(self, requests) -> RequestGroup:
        """The listed requests as a ``RequestGroup`` (made at the first call of the step for
        that list, then reused)."""
        requests = tuple(requests)
        group = self._groups.get(requests)
        if group is not None:
            return group
        n = len(self.q_lens)
        if not requests or any(not 0 <= b < n for b in requests) or len(set(requests)) < len(requests):
            raise ValueError(f"StepContext.group needs distinct requests in range(0, {n}), got {list(requests)}")
        starts = list(itertools.accumulate(self.q_lens, initial=0))
        device = self.cu_q_lens.device
        rows = torch.tensor([r for b in requests for r in range(starts[b], starts[b + 1])], device=device)
        q_lens = tuple(self.q_lens[b] for b in requests)
        cu = torch.tensor(list(itertools.accumulate(q_lens, initial=0)), dtype=self.cu_q_lens.dtype, device=device)
        step = dataclasses.replace(self, seqs=[self.seqs[b] for b in requests], q_lens=q_lens, cu_q_lens=cu,
                                   is_decode=all(m == 1 for m in q_lens), views=[],
                                   positions=None if self.positions is None else self.positions[rows])
        group = RequestGroup(requests, torch.tensor(requests, device=device), rows, step)
        self._groups[requests] = group
        return group


_CONTEXT: StepContext | None = None


def set_step_context(ctx: StepContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_step_context() -> StepContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside an engine step (no StepContext set)")
    return _CONTEXT
