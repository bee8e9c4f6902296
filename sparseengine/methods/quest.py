"""Quest (Tang et al., ICML 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context
LLM Inference"): all KV stays resident in pages of ``quest_page_size`` tokens, each with
per-channel key max/min per KV head, updated as tokens are appended. A decode query
bounds every page's best q·k by ``sum_c max(q_c M_c, q_c m_c)``, takes the max over the
group's query heads, and attends exactly over the top ``budget / quest_page_size`` pages
(at least 3) plus the pages holding sink and recent tokens. The first
``quest_skip_layers`` layers and prefill stay dense.

Quest pages are the KV cache's pages (``quest_page_size`` must equal ``page_size``), so
the page bounds live in one pool per layer, ``kmax/kmin [num_pages, Hkv, d]`` in the KV
dtype, indexed by physical page and refreshed after every K write (a page's offset 0
resets it, so a freed page needs no cleanup). Every step is batched, with no per-request
Python and no host sync on the decode path: one scoring call over every request's page
table (Triton, or ``kernels.quest_scores_cuda`` where that runs and is switched on), one page
choice (:func:`select_pages_batched`, or its Triton twin ``kernels.quest_select_pages_triton``
on a Triton provider, or its CUDA twin ``kernels.quest_select_cuda`` where that runs), a
page-mode ``Selection`` of fixed width.
The CUDA decode graph captures it.
"""

from __future__ import annotations

import torch

from sparseengine import kernels
from sparseengine.config import ConfigError
from sparseengine.engine.step_context import Selection
from sparseengine.kernels import pdl, quest_scores, quest_scores_cuda, quest_select, quest_select_cuda
from sparseengine.kernels.quest import update_page_minmax_torch
from sparseengine.kernels.quest_scores import quest_page_scores_torch
from sparseengine.method_registry import MethodSpec
from sparseengine.methods.base import SparseMethodRuntime


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def selection_width(page_size: int, sink_tokens: int, budget: int, recent_tokens: int) -> int:
    """The most pages ``quest_select_pages`` ever selects for one (request, KV head): sink
    pages + ``max(3, budget // page_size)`` + the recent window's pages (one more when it
    straddles a page boundary), or every page of a request within the total."""
    sink_pages = _cdiv(sink_tokens, page_size)
    recent_pages = 0 if recent_tokens == 0 else 1 + _cdiv(recent_tokens - 1, page_size)
    chosen = sink_pages + max(3, budget // page_size) + recent_pages
    return max(chosen, _cdiv(sink_tokens + budget + recent_tokens, page_size))


def select_pages_batched(scores: torch.Tensor, kv_lens: torch.Tensor, page_size: int, sink_tokens: int,
                         recent_tokens: int, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quest_select_pages`` for every request at once (ties aside: ``torch.topk`` does not
    promise the earlier page). ``scores [B, Hkv, P]``: page bounds (entries past request
    b's ``ceil(kv_lens[b] / page_size)`` pages ignored). Returns ``(pages [B, Hkv, K]``
    int64, logical pages ascending, -1 past the count; ``counts [B, Hkv]`` int32), ``K =
    min(selection_width(...), P)``. A request within ``sink + budget + recent`` tokens (or
    whose sink and recent pages meet) gets all its pages."""
    B, H, P = scores.shape
    device, ps = scores.device, page_size
    n = kv_lens.to(device).long()[:, None]  # [B, 1]
    n_pages = (n + ps - 1) // ps
    sink_pages, top = _cdiv(sink_tokens, ps), max(3, budget // ps)
    recent_first = (n - recent_tokens) // ps if recent_tokens else n_pages  # first page with a recent token
    everything = (n <= sink_tokens + budget + recent_tokens) | (recent_first <= sink_pages)
    page = torch.arange(P, device=device)[None, :]
    valid = page < n_pages
    forced = valid & (everything | (page < sink_pages) | (page >= recent_first))  # [B, P]
    priority = scores.float().masked_fill(~valid[:, None, :], float("-inf"))
    priority = priority.masked_fill(forced[:, None, :], float("inf"))
    k = min(selection_width(ps, sink_tokens, budget, recent_tokens), P)
    ranked = priority.topk(k, dim=-1, sorted=True).indices  # forced pages first, then by bound
    middle = (recent_first - sink_pages).clamp(min=0, max=top)
    counts = torch.where(everything, n_pages, sink_pages + middle + n_pages - recent_first)  # [B, 1]
    keep = torch.arange(k, device=device)[None, None, :] < counts[:, :, None]
    pages = torch.where(keep, ranked, P).sort(dim=-1).values
    pages = torch.where(pages == P, -1, pages)
    return pages, counts.to(torch.int32).expand(B, H).contiguous()


class Quest(SparseMethodRuntime):
    def __init__(self, config, model, cache) -> None:
        super().__init__(config, model, cache)
        self.page = int(self.knob("quest_page_size"))
        self.skip = int(self.knob("quest_skip_layers"))
        if self.page != config.page_size:
            raise ConfigError(f"quest_page_size={self.page} must equal page_size={config.page_size}: Quest keeps "
                              "its page bounds per KV-cache page; set both to the same value (default 16)")
        self._bounds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (kmax, kmin)
        self._rows_of, self._rows = None, ()  # the step context _prefill_rows last saw, its answer
        for layer in range(self.skip, model.num_layers if cache is not None else 0):
            self._page_bounds(layer, cache.kv.layer(layer)[0])  # allocated now: the pool was sized for them

    def graph_capturable(self) -> bool:
        return True

    @classmethod
    def bytes_per_pool_page(cls, config, model, elem_bytes: int) -> int:
        layers = max(0, model.num_layers - int(config.knob("quest_skip_layers")))
        return 2 * layers * model.num_kv_heads * model.head_dim * elem_bytes  # kmax + kmin

    def select(self, layer, q, ctx):
        if layer < self.skip:
            return None
        cfg, view = self.config, ctx.views[layer]
        k_cache, _ = ctx.kv_cache.layer(layer)
        kmax, kmin = self._page_bounds(layer, k_cache)
        triton = ctx.provider.triton_kernels
        dense = self._prefill_rows(ctx)
        # a decode step's keys (one a row, its last) fold into the bounds inside the scoring
        fold = triton and ctx.is_decode and view.slot_mapping.shape[0] == q.shape[0] and not all(dense)
        if not fold:
            update = kernels.update_page_minmax_triton if triton else update_page_minmax_torch
            update(k_cache, view.slot_mapping, kmax, kmin)
        if all(dense):
            return None
        q_last = q if ctx.is_decode else q[ctx.cu_q_lens[1:].long() - 1]
        args = (q_last, kmax, kmin, view.page_table, view.kv_lens, self.page)
        new_keys = {"k_cache": k_cache, "new_slots": view.slot_mapping} if fold else {}
        choice = (view.kv_lens, self.page, cfg.sink_tokens, cfg.recent_tokens, cfg.budget)
        if not triton:
            return Selection(*select_pages_batched(quest_page_scores_torch(*args), *choice), dense,
                             page_size=self.page)
        if quest_select_cuda.takes(q.device, view.page_table.shape[1]):  # the CUDA choice needs no group maxima
            cuda = quest_scores_cuda.takes(q_last, kmax)
            score = quest_scores_cuda.quest_page_scores_cuda if cuda else kernels.quest_page_scores_triton
            scores = score(*args, **new_keys)
            return Selection(*quest_select_cuda.quest_select_pages_cuda(scores, *choice), dense, page_size=self.page)
        group = quest_select.maxima_group(view.page_table.shape[1], self.page, cfg.budget,
                                          quest_scores.SCORE_BLOCK_P)
        if group is None:
            scores, maxima = kernels.quest_page_scores_triton(*args, **new_keys), None
        else:  # the shortlist's group maxima from the same launch
            scores, maxima = kernels.quest_page_scores_and_maxima_triton(
                *args, group=group, sink_pages=_cdiv(cfg.sink_tokens, self.page), recent_tokens=cfg.recent_tokens,
                **new_keys)
        pages, counts = kernels.quest_select_pages_triton(scores, *choice, group_maxima=maxima)
        return Selection(pages, counts, dense, page_size=self.page)

    def kernels(self, device, provider) -> dict[str, str]:
        if not provider.triton_kernels:
            return {"quest_select": "torch"}
        if not quest_select_cuda.takes(device, 1):
            return {"quest_select": "triton"}
        dtype = next(iter(self._bounds.values()))[0].dtype if self._bounds else None
        shape = (self.model.num_heads, self.model.num_kv_heads, self.model.head_dim, dtype)
        scores = quest_scores_cuda.ENGINE and quest_scores_cuda.shape_reason(*shape) is None
        triton = "triton pdl" if quest_scores.SCORE_PDL and pdl.available(device) else "triton"
        return {"quest_select": f"cuda (rows of up to {quest_select_cuda.max_pages()} pages, triton past them)",
                "quest_scores": "cuda" if scores else triton}

    def _prefill_rows(self, ctx) -> tuple[bool, ...]:
        """Which rows of the step are prefill rows (read densely): once per step, not per
        layer. A CUDA-graph capture (requests None) has decode rows only."""
        if self._rows_of is not ctx:
            self._rows_of = ctx
            self._rows = tuple(s is not None and not s.is_decoding for s in ctx.seqs)
        return self._rows

    def init_synthetic(self, seq) -> None:
        """Page bounds of the request's synthesised KV (written straight into the cache)."""
        for layer in range(self.skip, len(seq.layer_lens)):
            k_cache, _ = self.cache.kv.layer(layer)
            kmax, kmin = self._page_bounds(layer, k_cache)
            n = seq.layer_lens[layer]
            tokens = torch.arange(n, device=k_cache.device)
            table = torch.tensor(seq.page_table, dtype=torch.long, device=k_cache.device)
            slots = table[tokens // self.page] * self.page + tokens % self.page
            update_page_minmax_torch(k_cache, slots, kmax, kmin)

    def tokens_read(self, seq) -> list[int]:
        return [n if l < self.skip else self._tokens_selected(n) for l, n in enumerate(seq.layer_lens)]

    def metadata_bytes_read(self, seq, kv_bytes_per_token_layer: int) -> int:
        # per page and KV head: the channel max and min in the KV dtype (2 x d elements),
        # as many bytes as one token's K+V; the scores read every page of the request
        return sum(_cdiv(n, self.page) * kv_bytes_per_token_layer for n in seq.layer_lens[self.skip:])

    def _tokens_selected(self, n: int) -> int:
        """Tokens in the pages one decode query of an n-token cache selects (at most: with
        no recent tokens, a partial last page may be among the top pages)."""
        cfg, ps = self.config, self.page
        sink_pages = _cdiv(cfg.sink_tokens, ps)
        recent_first = (n - cfg.recent_tokens) // ps if cfg.recent_tokens else _cdiv(n, ps)
        if n <= self.total or recent_first <= sink_pages:
            return n
        middle = min(max(3, cfg.budget // ps), recent_first - sink_pages)
        return min(n, (sink_pages + middle) * ps + max(0, n - recent_first * ps))

    def _page_bounds(self, layer: int, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``(kmax, kmin) [num_pages, Hkv, d]``, allocated at first use."""
        bounds = self._bounds.get(layer)
        if bounds is None:
            num_pages, _, hkv, d = k_cache.shape
            bounds = self._bounds[layer] = (k_cache.new_zeros(num_pages, hkv, d), k_cache.new_zeros(num_pages, hkv, d))
        return bounds


SPEC = MethodSpec(
    name="quest", kind="decode", family="query_aware_selection", runtime=Quest,
    prefill_policy="all_chunked", knobs={"quest_page_size": 16, "quest_skip_layers": 2},
    paper="Tang et al., Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference, ICML 2024")
