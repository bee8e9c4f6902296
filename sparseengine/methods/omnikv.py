"""OmniKV (Hao et al., ICLR 2025, "OmniKV: Dynamic Context Selection for Efficient
Long-Context LLMs"): all KV stays resident. At each decode step a few dense "filter"
layers score every cached token by the max over query heads of q·k (``omnikv_score`` =
``logits``) or of the softmax probabilities (``probs``), pick sink + top-``budget`` +
recent, and that one index set is shared by every head of the following layers up to
the next filter layer. Layers before the first filter layer are dense; prefill is dense.

Two paths choose the tokens at a filter layer:
- pure-decode steps (every request feeds its one decode token; CUDA-graph capturable):
  with ``logits`` scores the filter layer's own dense attention emits every token's max
  logit per KV head while it reads K (``ScoreRows(kind="max_logits")``, handed to
  :meth:`OmniKV.observe`), so K is read once; ``probs`` needs each head's softmax
  normaliser first, so one scoring call reads K again (:func:`score_cached_tokens`).
  Then one batched sink + top-``budget`` + recent pick (:func:`pick_tokens`, or on a
  Triton provider :func:`gpu_pick`'s: ``kernels.omnikv_select_cuda`` on an sm_90 GPU, one
  launch, else ``kernels.omnikv_select_triton``; both fold in the max over KV heads and
  give ties to the earlier token), a fixed-width Selection. No per-request Python, no host
  sync, no allocation whose size depends on device values.
- mixed prefill + decode steps: per request (:func:`choose_tokens`), prefill rows dense.
Both choose what ``selection.omnikv_select(selection.omnikv_token_scores(...))`` defines,
ties aside on the torch path (its batched top-k does not promise ties to the earlier
token; the GPU picks do).
"""

from __future__ import annotations

import torch

from sparseengine import kernels
from sparseengine.config import ConfigError
from sparseengine.engine.step_context import ScoreRows, Selection
from sparseengine.kernels import omnikv_select_cuda
from sparseengine.kernels.omnikv_scores import omnikv_scores_torch
from sparseengine.method_registry import MethodSpec
from sparseengine.models.names import table_entry
from sparseengine.methods.base import SparseMethodRuntime
from sparseengine.methods.selection import omnikv_select, omnikv_token_scores

# Filter layers per model. Llama-3.1-8B: the OmniKV paper's choice. SmolLM2-135M: measured
# (scripts/omnikv_filter_recall.py -> results/omnikv_filter_recall_smollm2.csv): with the
# first filter at layer 2, layers 4 and 21 give the best mean top-512 recall of the later
# layers' choices (0.539 against 0.509 for a depth-scaled 2,8,16). Qwen3-8B (36 layers):
# Llama's layers scaled by depth (36/32), not measured: its weights cannot be fetched here.
FILTER_LAYERS = {
    "llama-3.1-8b": "2,8,18",
    "qwen3-8b": "2,9,20",
    "smollm2-135m-instruct": "2,4,21",
}


def parse_layers(spec: str, num_layers: int, option: str) -> list[int]:
    try:
        layers = sorted({int(x) for x in str(spec).split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"Invalid {option}={spec!r}: expected comma-separated layer numbers like '2,8,18'")
    if not layers or layers[0] < 0 or layers[-1] >= num_layers:
        raise ConfigError(f"Invalid {option}={spec!r}: layers must lie in [0, {num_layers - 1}]")
    return layers


def filter_layers_for(model, given: str, option: str, table: dict[str, str]) -> list[int]:
    spec = given or table_entry(table, model.name)
    if not spec:
        raise ConfigError(f"Model {model.name!r} has no default {option}; set {option} "
                          f"(e.g. {option}='2,8,18'). Known models: {', '.join(sorted(table))}")
    return parse_layers(spec, model.num_layers, option)


def choose_tokens(rt: SparseMethodRuntime, layer: int, q: torch.Tensor, ctx, mode: str) -> list[torch.Tensor | None]:
    """A filter layer's choice per request (None: prefill row or prompt within the total)."""
    cfg, out, start = rt.config, [], 0
    for seq, n in zip(ctx.seqs, ctx.q_lens):
        length = seq.layer_lens[layer] + n
        if not seq.is_decoding or length <= rt.total:
            out.append(None)
        else:
            k, _ = rt.cache.gather(seq, layer, length)
            scores = omnikv_token_scores(q[start + n - 1], k, mode)
            out.append(omnikv_select(scores, cfg.sink_tokens, cfg.budget, cfg.recent_tokens))
        start += n
    return out


def score_cached_tokens(q: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor,
                        kv_lens: torch.Tensor, mode: str, triton: bool) -> torch.Tensor:
    """Every cached token's score ``[B, max_pages * page_size]`` (fp32, -inf past
    ``kv_lens[b]``) for decode queries ``q [B, Hq, d]``: the Triton kernel, or its
    vectorised torch twin. The width comes from the page table, never from the lengths
    (no sync; in a CUDA graph the page table is as wide as ``max_model_len`` needs)."""
    score = kernels.omnikv_scores_triton if triton else omnikv_scores_torch
    return score(q, k_cache, page_table, kv_lens, mode, page_table.shape[1] * k_cache.shape[1])


def pick_tokens(scores: torch.Tensor, kv_lens: torch.Tensor, sink: int, budget: int,
                recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``omnikv_select`` for every row at once. Row b: ``scores [B, L]`` of its
    ``n = kv_lens[b]`` tokens (entries past n ignored). Returns ``(indices [B, K]`` int64,
    ``counts [B]`` int32), ``K = sink + budget + recent``: when ``n > K``, tokens
    ``[0, sink)``, the top-``budget`` of ``[sink, n - recent)`` by score (ascending), then
    ``[n - recent, n)``, count K; otherwise ``0 .. K-1`` with count n (all n tokens)."""
    rows, width = scores.shape
    total = sink + budget + recent
    device = scores.device
    everything = torch.arange(total, device=device).expand(rows, total)
    counts = kv_lens.clamp(max=total).to(torch.int32)
    if width <= total:  # no row can hold more than the total
        return everything, counts
    n = kv_lens.to(device=device, dtype=torch.long)[:, None]  # [B, 1]
    pos = torch.arange(width, device=device)
    middle = (pos >= sink) & (pos < n - recent)  # [B, L]
    top = scores.masked_fill(~middle, float("-inf")).topk(budget, dim=-1, sorted=False).indices
    tail = n - recent + torch.arange(recent, device=device)  # [B, recent]
    chosen = torch.cat([everything[:, :sink], top.sort(dim=-1).values, tail], dim=-1)
    return torch.where(n > total, chosen, everything), counts


class OmniKV(SparseMethodRuntime):
    def __init__(self, config, model, cache) -> None:
        super().__init__(config, model, cache)
        self.filters = filter_layers_for(model, self.knob("omnikv_filter_layers"), "omnikv_filter_layers",
                                         FILTER_LAYERS)
        self.filter_set = frozenset(self.filters)
        self.mode = str(self.knob("omnikv_score"))
        if self.mode not in ("logits", "probs"):
            raise ConfigError(f"Invalid omnikv_score={self.mode!r}; valid: logits, probs")
        self._selection: Selection | None = None  # the last filter layer's choice, this step

    def graph_capturable(self) -> bool:
        return True

    def begin_step(self, ctx) -> None:
        super().begin_step(ctx)
        self._selection = None

    def select(self, layer, q, ctx):
        if layer < self.filters[0]:
            return None
        if layer in self.filter_set:
            if self._fused(ctx):
                self._selection = None  # observe() chooses from the attention's own logits
            else:
                self._selection = (self._choose_batched(layer, q, ctx) if pure_decode(ctx)
                                   else self._choose_per_request(layer, q, ctx))
            return None  # filter layers attend densely
        return self._selection

    def score_rows(self, layer, ctx):
        """Pure decode, ``logits`` scores: a filter layer's dense attention reports every
        token's max logit per KV head."""
        return max_logit_rows(layer, ctx) if layer in self.filter_set and self._fused(ctx) else None

    def observe(self, layer, q, colsums, ctx):
        """The filter layer's choice from its attention's max logits ``[B, G, L]`` (G: Hkv, or 1
        where the attention took the max over KV heads itself); the Triton pick also writes
        the chosen tokens' pool rows (``Selection.pool_rows``)."""
        view, triton = ctx.views[layer], ctx.provider.triton_kernels
        wants_rows = triton and kernels.omnikv_select.EMIT_POOL_ROWS
        rows_of = (view.page_table, ctx.kv_cache.layer(layer)[0].shape[1]) if wants_rows else None
        self._selection = self._selection_of(*pick_from_max_logits(colsums, view.kv_lens, self.config, triton,
                                                                   rows_of))

    def kernels(self, device, provider) -> dict[str, str]:
        return {"omnikv_select": pick_kernel(device, provider)}

    def _fused(self, ctx) -> bool:
        return self.mode == "logits" and pure_decode(ctx)

    def tokens_read(self, seq) -> list[int]:
        dense = self.filter_set | set(range(self.filters[0]))
        return [n if l in dense else min(n, self.total) for l, n in enumerate(seq.layer_lens)]

    def metadata_bytes_read(self, seq, kv_bytes_per_token_layer: int) -> int:
        """``logits`` (pure decode): :func:`max_logit_bytes_per_token` per token.
        ``probs``: the scoring pass is not fused with the attention: it reads the layer's K
        again (half of K+V per token) twice (softmax partials, then the scores; the
        attention's lse is computed after the choice) and writes one fp32 score per token,
        which the pick reads (plus :func:`pick_key_bytes`)."""
        device = self.cache.kv.device
        if self.mode == "logits":
            per_token = max_logit_bytes_per_token(self.model.num_kv_heads, device)
        else:
            per_token = 2 * kv_bytes_per_token_layer // 2 + 2 * 4 + pick_key_bytes(device)
        return sum(seq.layer_lens[l] * per_token for l in self.filters)

    def _choose_batched(self, layer, q, ctx) -> Selection:
        """Pure decode, unfused scores (``probs``): one index set per request (width fixed
        at the total), shared by every KV head; requests within the total read all their
        tokens."""
        k_cache, _ = ctx.kv_cache.layer(layer)
        view = ctx.views[layer]
        triton = ctx.provider.triton_kernels
        scores = score_cached_tokens(q, k_cache, view.page_table, view.kv_lens, self.mode, triton)
        pick = gpu_pick(scores) if triton else pick_tokens
        cfg = self.config
        return self._selection_of(*pick(scores, view.kv_lens, cfg.sink_tokens, cfg.budget, cfg.recent_tokens))

    def _selection_of(self, idx: torch.Tensor, counts: torch.Tensor, pool_rows: torch.Tensor | None = None
                      ) -> Selection:
        """``pick_tokens``' choice, one index set (and its pool rows) shared by every KV head."""
        rows, hkv = idx.shape[0], self.model.num_kv_heads
        shared = (lambda t: t[:, None, :].expand(rows, hkv, t.shape[1]))  # noqa: E731
        # counts a view too (stride 0 over the heads): every attention reads num_selected by its strides, and a
        # copy would be a launch a filter layer
        return Selection(shared(idx), counts[:, None].expand(rows, hkv), dense=(False,) * rows,
                         pool_rows=None if pool_rows is None else shared(pool_rows))

    def _choose_per_request(self, layer, q, ctx) -> Selection | None:
        chosen = choose_tokens(self, layer, q, ctx, self.mode)
        if all(c is None for c in chosen):
            return None
        return Selection.from_lists(chosen, self.model.num_kv_heads, q.device)


def max_logit_rows(layer: int, ctx) -> ScoreRows:
    """A pure-decode step's request for every cached token's max logit per KV head, as
    wide as the page table (a static shape: a CUDA graph captures it)."""
    page_size = ctx.kv_cache.layer(layer)[0].shape[1]
    return ScoreRows((1,) * len(ctx.seqs), max_kv_len=ctx.views[layer].page_table.shape[1] * page_size,
                     kind="max_logits")


def pick_from_max_logits(colsums: torch.Tensor, kv_lens: torch.Tensor, config,
                         triton: bool = False, rows_of: tuple[torch.Tensor, int] | None = None) -> tuple:
    """``pick_tokens`` over the max over dim 1 of a filter layer's max logits ``[B, G, L]``
    (per KV head, or G = 1: already over all heads; the ``logits`` score) -> (indices,
    counts); ``triton``: a GPU pick that takes that max itself (``kernels.omnikv_select_cuda``,
    one cluster launch, where it ``takes`` the scores; else the Triton pick, six kernels and a
    memset; either instead of torch's max, top-k and sort), and given ``rows_of`` (page table,
    page size) also returns the chosen tokens' pool rows."""
    cfg = config
    if triton:
        table, page_size = rows_of if rows_of is not None else (None, 0)
        pick = gpu_pick(colsums, table)
        return pick(colsums, kv_lens, cfg.sink_tokens, cfg.budget, cfg.recent_tokens, page_table=table,
                    page_size=page_size)
    return pick_tokens(colsums.amax(dim=1), kv_lens, cfg.sink_tokens, cfg.budget, cfg.recent_tokens)


def gpu_pick(scores: torch.Tensor, page_table: torch.Tensor | None = None):
    """The pick a Triton provider runs on these scores (either score mode):
    ``kernels.omnikv_select_cuda`` where it ``takes`` them, else ``kernels.omnikv_select_triton``."""
    if omnikv_select_cuda.takes(scores, page_table):
        return omnikv_select_cuda.omnikv_select_cuda
    return kernels.omnikv_select_triton


def pick_key_bytes(device=None) -> int:
    """Bytes the GPU pick moves per cached token beyond reading its scores, on `device`: none
    for the CUDA pick (where it ``runs_on`` the device: its keys stay in shared memory); the
    Triton pick's first pass writes one int32 key that its five later passes read (three
    radix passes, the counts, the output)."""
    return 0 if device is not None and omnikv_select_cuda.runs_on(device) else 6 * 4


def pick_kernel(device, provider) -> str:
    """Which implementation makes a filter layer's pick on `device` beside `provider` (for the
    records): ``cuda`` (rows of up to ``max_tokens()``, Triton past them), ``triton``, ``torch``."""
    if not provider.triton_kernels:
        return "torch"
    if omnikv_select_cuda.runs_on(device):
        return f"cuda (clusters of {omnikv_select_cuda.CLUSTER}, rows of up to {omnikv_select_cuda.max_tokens()} " \
               "tokens, triton past them)"
    return "triton"


def max_logit_bytes_per_token(num_kv_heads: int, device=None) -> int:
    """Bytes a fused ``logits`` choice moves per cached token of a filter layer on a Triton
    provider (the benchmark's path) on `device`. With the KV heads folded in by the attention
    (``omnikv_scores.FOLD_KV_HEADS``, the default): one fp32 score filled with -inf, then
    written by the attention's atomic max and read by the pick; else one fp32 max logit per
    KV head written by the attention (no fill: the pick reads each row's tokens only) and
    read by the pick; plus :func:`pick_key_bytes`. The torch path moves more (its scores
    filled with -inf first, the max over heads written, then read and written by the masking,
    read by the top-k), in many more launches."""
    scores = 3 * 4 if kernels.omnikv_scores.FOLD_KV_HEADS else 2 * 4 * num_kv_heads
    return scores + pick_key_bytes(device)


def pure_decode(ctx) -> bool:
    """Every request feeds its one decode token (a one-token prefill chunk does not count).
    A CUDA-graph capture has no host requests (``ctx.seqs`` is ``[None] * B``)."""
    return ctx.is_decode and all(s is None or s.is_decoding for s in ctx.seqs)


SPEC = MethodSpec(
    name="omnikv", kind="decode", family="logical_masking", runtime=OmniKV,
    prefill_policy="all_chunked", knobs={"omnikv_filter_layers": "", "omnikv_score": "logits"},
    paper="Hao et al., OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs, ICLR 2025")
