"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
Large Language Models"): each cached token accumulates the attention probability it has
received from every query row so far (column sums emitted by the attention itself,
averaged over the query heads of its KV head). When a row exceeds the total, keep sink +
the last ``recent_tokens`` + the top-``budget`` others by accumulated score, carrying
their scores forward. Evicts at the end of prefill and every ``h2o_decode_interval``
decode steps."""

from __future__ import annotations

import torch

from sparseengine.engine.step_context import ScoreRows
from sparseengine.method_registry import MethodSpec
from sparseengine.methods.base import SparseMethodRuntime
from sparseengine.methods.selection import h2o_keep


class H2O(SparseMethodRuntime):
    def __init__(self, config, model, cache) -> None:
        super().__init__(config, model, cache)
        self.interval = int(self.knob("h2o_decode_interval"))
        self._rows: ScoreRows | None = None

    def cache_lens_after_prefill(self, n: int) -> list[int]:
        return [min(n, self.total)] * self.model.num_layers

    def max_cache_tokens(self, n: int, output_tokens: int) -> int:
        return min(n + output_tokens, self.total + self.interval)

    def init_synthetic(self, seq) -> None:
        k_cache, _ = self.cache.kv.layer(0)
        self.cache.state(seq)["h2o_acc"] = {
            l: torch.rand(self.model.num_kv_heads, n, device=k_cache.device)
            for l, n in enumerate(seq.layer_lens)}
        self.cache.state(seq)["decode_steps"] = 0

    def begin_step(self, ctx) -> None:
        super().begin_step(ctx)
        self._rows = ScoreRows(tuple(ctx.q_lens))

    def score_rows(self, layer, ctx):
        return self._rows

    def observe(self, layer, q, colsums, ctx) -> None:
        for seq, cs in zip(ctx.seqs, colsums):
            acc = self.cache.state(seq).setdefault("h2o_acc", {})
            prev = acc.get(layer)
            cs = cs.float()
            if prev is not None:
                cs = cs + torch.nn.functional.pad(prev, (0, cs.shape[1] - prev.shape[1]))
            acc[layer] = cs

    def finish_step(self, batch) -> None:
        ending, decoding = set(map(id, self.prefill_ending)), set(map(id, self.decoding))
        for seq in batch.seqs:
            st = self.cache.state(seq)
            if id(seq) in ending:
                st["decode_steps"] = 0
            elif id(seq) in decoding:
                st["decode_steps"] = st.get("decode_steps", 0) + 1
                if st["decode_steps"] % self.interval:
                    continue
            else:
                continue  # mid-prefill: the cache grows until the prompt ends
            self.evict(seq, st["h2o_acc"], self.config.budget)

    def evict(self, seq, acc: dict[int, torch.Tensor], budget: int) -> None:
        """Evict every layer past the total; layers of one length in one batched pick and
        one compaction."""
        cfg = self.config
        groups: dict[int, list[int]] = {}
        for layer, n in enumerate(seq.layer_lens):
            if n > cfg.sink_tokens + budget + cfg.recent_tokens:
                groups.setdefault(n, []).append(layer)
        for layers in groups.values():
            scores = torch.stack([acc[layer] for layer in layers])  # [G, Hkv, n]
            g, hkv, _ = scores.shape
            keep = h2o_keep(scores.flatten(0, 1), cfg.sink_tokens, budget, cfg.recent_tokens).view(g, hkv, -1)
            kept = scores.gather(2, keep.to(scores.device))
            for i, layer in enumerate(layers):
                acc[layer] = kept[i]
            self.cache.compact_layers(seq, keep, layers)
        if groups:
            self.cache.trim_pages(seq)


SPEC = MethodSpec(
    name="h2o", kind="decode", family="physical_eviction", runtime=H2O,
    prefill_policy="all_chunked", needs_scores=True, frees_memory=True,
    knobs={"h2o_decode_interval": 1},
    paper="Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs, NeurIPS 2023")
