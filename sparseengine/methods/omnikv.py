"""OmniKV (Hao et al., ICLR 2025, "OmniKV: Dynamic Context Selection for Efficient
Long-Context LLMs"): all KV stays resident. At each decode step a few dense "filter"
layers score every cached token by the max over query heads of q·k (``omnikv_score`` =
``logits``) or of the softmax probabilities (``probs``), pick sink + top-``budget`` +
recent, and that one index set is shared by every head of the following layers up to
the next filter layer. Layers before the first filter layer are dense; prefill is dense.
"""

from __future__ import annotations

import torch

from sparseengine.config import ConfigError
from sparseengine.engine.step_context import Selection
from sparseengine.method_registry import MethodSpec
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
    spec = given or table.get(model.name)
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


class OmniKV(SparseMethodRuntime):
    def __init__(self, config, model, cache) -> None:
        super().__init__(config, model, cache)
        self.filters = filter_layers_for(model, self.knob("omnikv_filter_layers"), "omnikv_filter_layers",
                                         FILTER_LAYERS)
        self.mode = str(self.knob("omnikv_score"))
        if self.mode not in ("logits", "probs"):
            raise ConfigError(f"Invalid omnikv_score={self.mode!r}; valid: logits, probs")
        self._chosen: list[torch.Tensor | None] | None = None

    def begin_step(self, ctx) -> None:
        super().begin_step(ctx)
        self._chosen = None

    def select(self, layer, q, ctx):
        if layer < self.filters[0]:
            return None
        if layer in self.filters:
            self._chosen = self._choose(layer, q, ctx)
            return None  # filter layers attend densely
        if self._chosen is None or all(c is None for c in self._chosen):
            return None
        return Selection.from_lists(self._chosen, self.model.num_kv_heads, q.device)

    def tokens_read(self, seq) -> list[int]:
        dense = set(self.filters) | set(range(self.filters[0]))
        return [n if l in dense else min(n, self.total) for l, n in enumerate(seq.layer_lens)]

    def _choose(self, layer, q, ctx) -> list[torch.Tensor | None]:
        return choose_tokens(self, layer, q, ctx, self.mode)


SPEC = MethodSpec(
    name="omnikv", kind="decode", family="logical_masking", runtime=OmniKV,
    prefill_policy="all_chunked", knobs={"omnikv_filter_layers": "", "omnikv_score": "logits"},
    paper="Hao et al., OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs, ICLR 2025")
