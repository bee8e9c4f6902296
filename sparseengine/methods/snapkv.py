"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before
Generation"): at the end of prefill, score prefix tokens by the attention the last
``snapkv_window`` queries paid them (column sums emitted by the prefill attention itself,
averaged over each KV head's query heads, then pooled), keep sink + top-``budget`` +
the last ``max(recent_tokens, window)`` per layer and KV head, and evict the rest.

Optional decode eviction (``snapkv_decode_eviction``): every ``snapkv_decode_interval``
decode steps, rescore with the column sums of the last ``snapkv_window`` decode queries
and compact back to the total.

``layer_budget(layer, n)`` is the seam PyramidKV overrides.
"""

from __future__ import annotations

import torch

from sparseengine.engine.step_context import ScoreRows
from sparseengine.method_registry import MethodSpec
from sparseengine.methods.base import SparseMethodRuntime
from sparseengine.methods.selection import snapkv_keep, snapkv_pool


class SnapKV(SparseMethodRuntime):
    def __init__(self, config, model, cache) -> None:
        super().__init__(config, model, cache)
        self.window = int(self.knob("snapkv_window"))
        self.kernel = int(self.knob("snapkv_kernel"))
        self.pooling = str(self.knob("snapkv_pooling"))
        self.decode_eviction = bool(self.knob("snapkv_decode_eviction"))
        self.interval = int(self.knob("snapkv_decode_interval"))
        self._rows: ScoreRows | None = None

    def layer_budget(self, layer: int, n: int) -> int:
        return self.config.budget

    def compresses(self, n: int) -> bool:
        """Anything to evict? Not when the prompt fits the total, nor when sink plus the
        last max(recent, window) tokens already cover it."""
        return n > self.total and self.config.sink_tokens + max(self.config.recent_tokens, self.window) < n

    def cache_lens_after_prefill(self, n: int) -> list[int]:
        cfg, tail = self.config, max(self.config.recent_tokens, self.window)
        if not self.compresses(n) or cfg.sink_tokens + tail >= n:
            return [n] * self.model.num_layers
        return [cfg.sink_tokens + min(self.layer_budget(l, n), n - tail - cfg.sink_tokens) + tail
                for l in range(self.model.num_layers)]

    def max_cache_tokens(self, n: int, output_tokens: int) -> int:
        kept = max(self.cache_lens_after_prefill(n))
        if not self.decode_eviction:
            return kept + output_tokens
        # a decode compaction leaves at most sink + the layer's budget + the tail; a row
        # below that (a short prompt) keeps growing until a compaction finds it longer
        tail = max(self.config.recent_tokens, self.window)
        steady = max(self.config.sink_tokens + self.layer_budget(l, n) + tail for l in range(self.model.num_layers))
        return min(kept + output_tokens, max(kept, steady) + self.interval)

    # ---- which rows report column sums ------------------------------------------------
    def begin_step(self, ctx) -> None:
        super().begin_step(ctx)
        rows = []
        for seq, n in zip(ctx.seqs, ctx.q_lens):
            st = self.cache.state(seq)
            if not seq.is_decoding:  # prefill rows inside the prompt's last window
                end, window_start = seq.num_computed_tokens + n, seq.num_tokens - self.window
                rows.append(max(0, end - max(window_start, seq.num_computed_tokens))
                            if self.compresses(seq.num_tokens) else 0)
            elif self.decode_eviction:
                step = st.get("decode_steps", 0)
                rows.append(1 if step % self.interval >= self.interval - self.window else 0)
            else:
                rows.append(0)
        self._rows = ScoreRows(tuple(rows)) if any(rows) else None

    def score_rows(self, layer, ctx):
        return self._rows

    def wants_forward_hooks(self, seqs) -> bool:
        return self.decode_eviction

    def begin_step_graph(self, seqs) -> None:
        super().begin_step_graph(seqs)
        self._rows = None

    def observe(self, layer, q, colsums, ctx) -> None:
        for seq, rows, cs in zip(ctx.seqs, self._rows.rows, colsums):
            if rows == 0:
                continue
            st = self.cache.state(seq)
            acc = st.setdefault("snap_acc", {})
            if not seq.is_decoding:
                prefix = seq.num_tokens - self.window
                cs = cs[:, :prefix]
            prev = acc.get(layer)
            if prev is None:
                acc[layer] = cs.float().clone()
            else:  # decode rows see one more token each step: pad the older sums
                width = max(prev.shape[1], cs.shape[1])
                acc[layer] = torch.nn.functional.pad(prev, (0, width - prev.shape[1])) + \
                    torch.nn.functional.pad(cs.float(), (0, width - cs.shape[1]))

    # ---- eviction ----------------------------------------------------------------------
    def finish_step(self, batch) -> None:
        for seq in self.prefill_ending:
            st = self.cache.state(seq)
            if self.compresses(seq.num_tokens):
                self._compress(seq, st.pop("snap_acc"), seq.num_tokens, self.window)
            st["decode_steps"] = 0
        if not self.decode_eviction:
            return
        for seq in self.decoding:
            st = self.cache.state(seq)
            st["decode_steps"] = st.get("decode_steps", 0) + 1
            if st["decode_steps"] % self.interval == 0 and "snap_acc" in st:
                self._compress(seq, st.pop("snap_acc"), seq.num_prompt_tokens, self.window)

    def _compress(self, seq, acc: dict[int, torch.Tensor], n: int, window: int) -> None:
        cfg = self.config
        for layer in range(self.model.num_layers):
            length = seq.layer_lens[layer]
            scores = snapkv_pool(acc[layer][:, : length - window], self.kernel, self.pooling)
            keep = snapkv_keep(scores, length, window, cfg.sink_tokens,
                               self.layer_budget(layer, n), cfg.recent_tokens)
            self.cache.compact(seq, layer, keep)
        self.cache.trim_pages(seq)


SPEC = MethodSpec(
    name="snapkv", kind="decode", family="physical_eviction", runtime=SnapKV,
    prefill_policy="all_chunked", needs_scores=True, frees_memory=True,
    knobs={"snapkv_window": 32, "snapkv_kernel": 7, "snapkv_pooling": "max",
           "snapkv_decode_eviction": False, "snapkv_decode_interval": 128},
    paper="Li et al., SnapKV: LLM Knows What You are Looking for Before Generation, NeurIPS 2024")
