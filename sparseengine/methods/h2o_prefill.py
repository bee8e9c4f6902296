"""h2o_prefill: chunked prefill that compacts the KV cache between prompt chunks with H2O
scores, so a prompt far longer than the KV pool can be prefilled.

Definition (METHODS.md "h2o_prefill", with the choices it leaves open fixed here):
- The prompt is prefilled in chunks (``all_chunked``). Every layer and KV head keeps an
  accumulated score ``h_j`` per cached token: the attention probability token j received
  from the scored rows of every chunk so far, averaged over the query heads of the KV
  head (the column sums the prefill attention emits; nothing is recomputed).
- Scored rows: the last ``h2o_prefill_window`` rows of each chunk (default 128; all of
  the chunk's rows when the chunk is shorter, or when ``h2o_prefill_window`` is 0).
  Score requests of stacked methods merge to the most rows, so paired with ``h2o``
  (which scores every row) the scores come from all of each chunk's rows.
- After each chunk (the last one included), a layer holding more than
  ``h2o_prefill_budget`` tokens keeps, per KV head, the first ``sink_tokens``, the last
  ``recent_tokens`` and the top ``h2o_prefill_budget - sink_tokens - recent_tokens`` others
  by ``h`` (``selection.h2o_keep``: ties to the earlier token), so exactly
  ``h2o_prefill_budget`` tokens stay; kept tokens carry their scores into the next chunk,
  new tokens start at 0. Pages no layer needs go back to the pool at once.
- Keys keep their original RoPE positions. A prompt of at most ``h2o_prefill_budget``
  tokens is never touched (exactly dense prefill).
- Decode: paired with ``vanilla`` the cache keeps what prefill left and grows by one token
  a step; paired with ``h2o`` its scores (token pools beside the cache) move with each
  compaction, and h2o evicts to its own total at prefill end and during decode.
Admission: a prompt needs at most ``h2o_prefill_budget + chunk`` cache slots
(``cache_tokens_needed``), whatever its length.
"""

from __future__ import annotations

from sparseengine.config import ConfigError
from sparseengine.engine.step_context import ScoreRows
from sparseengine.method_registry import MethodSpec
from sparseengine.methods.base import SparseMethodRuntime
from sparseengine.methods.selection import h2o_accumulate_colsums, h2o_keep

ACC = "h2o_prefill_acc"  # per request: {layer: [Hkv, layer_len] accumulated scores}


class H2OPrefill(SparseMethodRuntime):
    def __init__(self, config, model, cache) -> None:
        super().__init__(config, model, cache)
        self.budget_tokens = int(self.knob("h2o_prefill_budget"))
        self.window = int(self.knob("h2o_prefill_window"))
        fixed = config.sink_tokens + config.recent_tokens
        if self.budget_tokens < 1 or self.budget_tokens < fixed:
            raise ConfigError(
                f"Invalid h2o_prefill_budget={self.budget_tokens}: it is the total kept after each chunk and "
                f"must be at least sink_tokens + recent_tokens = {config.sink_tokens} + {config.recent_tokens} "
                f"(and at least 1)")
        self.middle = self.budget_tokens - fixed
        self._rows: ScoreRows | None = None
        self._prefilling: list = []

    def compacts(self, seq) -> bool:
        return seq.num_tokens > self.budget_tokens

    def cache_tokens_needed(self, prompt_tokens: int) -> int:
        chunk = min(self.config.prefill_chunk_size, self.config.max_num_batched_tokens)
        return min(prompt_tokens, self.budget_tokens + chunk)

    def cache_lens_after_prefill(self, prompt_tokens: int) -> list[int]:
        return [min(prompt_tokens, self.budget_tokens)] * self.model.num_layers

    def wants_forward_hooks(self, seqs) -> bool:
        return False  # nothing to do inside a pure-decode step

    def begin_step_graph(self, seqs) -> None:
        super().begin_step_graph(seqs)
        self._rows, self._prefilling = None, []

    # ---- which rows report column sums ------------------------------------------------
    def begin_step(self, ctx) -> None:
        super().begin_step(ctx)
        rows, self._prefilling = [], []
        for seq, n in zip(ctx.seqs, ctx.q_lens):
            if seq.is_decoding or not self.compacts(seq):
                rows.append(0)
                continue
            self._prefilling.append(seq)
            rows.append(n if self.window == 0 else min(self.window, n))
        self._rows = ScoreRows(tuple(rows)) if any(rows) else None

    def score_rows(self, layer, ctx):
        return self._rows

    def observe(self, layer, q, colsums, ctx) -> None:
        for seq, rows, cs in zip(ctx.seqs, self._rows.rows, colsums):
            if rows == 0:
                continue
            acc = self.cache.state(seq).setdefault(ACC, {})
            prev = acc.get(layer)
            acc[layer] = cs.float().clone() if prev is None else h2o_accumulate_colsums(prev, cs)

    # ---- compaction after each chunk ----------------------------------------------------
    def finish_step(self, batch) -> None:
        for seq in self._prefilling:
            st = self.cache.state(seq)
            acc = st.get(ACC)
            if acc is None:
                continue
            changed = False
            for layer in range(self.model.num_layers):
                length = seq.layer_lens[layer]
                if length <= self.budget_tokens:
                    continue
                if acc[layer].shape[1] != length:
                    raise RuntimeError(f"h2o_prefill scores cover {acc[layer].shape[1]} tokens of layer {layer}, "
                                       f"the cache holds {length}")
                keep = h2o_keep(acc[layer], self.config.sink_tokens, self.middle, self.config.recent_tokens)
                acc[layer] = acc[layer].gather(1, keep)
                self.cache.compact(seq, layer, keep)
                changed = True
            if changed:
                self.cache.trim_pages(seq)
            if seq.num_computed_tokens >= seq.num_tokens:  # prefill done: decode keeps what is left
                st.pop(ACC, None)
        self._prefilling = []


SPEC = MethodSpec(
    name="h2o_prefill", kind="prefill", family="physical_eviction", runtime=H2OPrefill,
    combines_with=("vanilla", "h2o"), needs_scores=True, frees_memory=True,
    knobs={"h2o_prefill_budget": 8192, "h2o_prefill_window": 128},
    paper="Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs, NeurIPS 2023 "
          "(applied between prefill chunks)")
