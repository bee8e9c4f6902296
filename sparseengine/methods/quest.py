"""Quest (Tang et al., ICML 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context
LLM Inference"): all KV stays resident in pages of ``quest_page_size`` tokens, each with
per-channel key max/min per KV head, updated as tokens are appended. A decode query
bounds every page's best q·k by ``sum_c max(q_c M_c, q_c m_c)``, takes the max over the
group's query heads, and attends exactly over the top ``budget / quest_page_size`` pages
(at least 3) plus the pages holding sink and recent tokens. The first
``quest_skip_layers`` layers and prefill stay dense."""

from __future__ import annotations

from sparseengine.engine.step_context import Selection
from sparseengine.method_registry import MethodSpec
from sparseengine.methods.base import SparseMethodRuntime
from sparseengine.methods.selection import (pages_to_tokens, quest_append_minmax, quest_page_bounds,
                                            quest_select_pages)


class Quest(SparseMethodRuntime):
    def __init__(self, config, model, cache) -> None:
        super().__init__(config, model, cache)
        self.page = int(self.knob("quest_page_size"))
        self.skip = int(self.knob("quest_skip_layers"))

    def select(self, layer, q, ctx):
        if layer < self.skip or not any(s.is_decoding for s in ctx.seqs):
            return None
        cfg, chosen, counts, start = self.config, [], [], 0
        for seq, n in zip(ctx.seqs, ctx.q_lens):
            length = seq.layer_lens[layer] + n
            if not seq.is_decoding or length <= self.total:
                chosen.append(None)
                counts.append(None)
            else:
                kmax, kmin = self._metadata(seq, layer, length)
                bounds = quest_page_bounds(q[start + n - 1], kmax, kmin)
                pages = quest_select_pages(bounds, length, self.page, cfg.sink_tokens, cfg.recent_tokens, cfg.budget)
                tokens, valid = pages_to_tokens(pages, self.page, length)
                chosen.append(tokens)  # sorted per head: a partial last page's tail comes last
                counts.append(valid.sum(-1))
            start += n
        if all(c is None for c in chosen):
            return None
        return Selection.from_lists(chosen, self.model.num_kv_heads, q.device, counts)

    def tokens_read(self, seq) -> list[int]:
        cap = self.config.sink_tokens + self.config.recent_tokens + max(3 * self.page, self.config.budget) + 2 * self.page
        return [n if l < self.skip else min(n, cap) for l, n in enumerate(seq.layer_lens)]

    def metadata_bytes_read(self, seq, kv_bytes_per_token_layer: int) -> int:
        # per page and KV head: float32 channel max and min (2 x d x 4 bytes), i.e. twice a
        # bf16 token's K+V (2 x d x 2 bytes)
        return sum(-(-n // self.page) * 2 * kv_bytes_per_token_layer for n in seq.layer_lens[self.skip:])

    def _metadata(self, seq, layer: int, length: int):
        """Per-page key max/min, extended with the tokens appended since the last call."""
        meta = self.cache.state(seq).setdefault("quest", {})
        kmax, kmin, seen = meta.get(layer, (None, None, 0))
        if seen < length:
            k_new, _ = self.cache.gather(seq, layer, length, start=seen)
            if kmax is None:
                kmax = k_new.new_empty(0, *k_new.shape[1:]).float()
                kmin = kmax.clone()
            kmax, kmin = quest_append_minmax(kmax, kmin, seen, k_new.float(), self.page)
            meta[layer] = (kmax, kmin, length)
        return kmax, kmin


SPEC = MethodSpec(
    name="quest", kind="decode", family="query_aware_selection", runtime=Quest,
    prefill_policy="all_chunked", knobs={"quest_page_size": 16, "quest_skip_layers": 2},
    paper="Tang et al., Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference, ICML 2024")
