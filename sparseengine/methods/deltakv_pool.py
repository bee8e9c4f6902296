"""Which layers DeltaKV compresses, and what that means for the KV pool (METHODS.md,
"deltakv"; ``deltakv.DeltaKV`` is the runtime on top of this class).

The engine keeps one page table per request, as long as its longest layer. Once a
request is compressed its sparse layers hold only its first ``narrow_tokens`` cache
indices (sink, scratch, raw tail), so they are the pool's narrow layers
(``engine/pool_plan.py``): the pool gives them pages only in its narrow tier, and right
after the first compression the request's pages past those indices move to the wide tier
(``CacheManager.move_to_wide``), which stores only the full layers (and reserves the
codec's bytes per token, ``bytes_per_wide_page``). With ``kv_pool_tiers=off`` every page
stays in every layer and the full layers pin the whole prompt's pages in all of them.
"""

from __future__ import annotations

import math

from sparseengine.methods.base import SparseMethodRuntime
from sparseengine.methods.deltakv_bytes import stored_bytes_per_token
from sparseengine.methods.deltakv_flush import FLUSH_TOKENS
from sparseengine.methods.deltakv_store import STATE_KEY
from sparseengine.methods.omnikv import FILTER_LAYERS, filter_layers_for

# The full layers choose tokens exactly as OmniKV's filter layers do: same per-model table.
FULL_LAYERS = FILTER_LAYERS


def layer_roles(model, given: str) -> tuple[list[int], list[int], list[int]]:
    """``(filters, full, sparse)``: the layers that choose tokens (``deltakv_full_layers``),
    every layer keeping its whole KV (those and all layers before the first), and the
    compressed ones."""
    filters = filter_layers_for(model, given, "deltakv_full_layers", FULL_LAYERS)
    full = sorted(set(filters) | set(range(filters[0])))
    sparse = [layer for layer in range(model.num_layers) if layer not in full]
    return filters, full, sparse


class DeltaKVPool(SparseMethodRuntime):
    """The pool hooks of ``SparseMethodRuntime`` for DeltaKV: its sparse layers are the
    narrow ones once a request is compressed."""

    @classmethod
    def kv_tokens_needed(cls, config, prompt_len: int, output_len: int) -> int:
        """Pool tokens per layer a request pins: all of them (full layers keep every token
        and the page table is shared by all layers)."""
        return prompt_len + output_len

    @classmethod
    def narrow_layers(cls, config, model) -> tuple[int, ...]:
        """The sparse layers."""
        return tuple(layer_roles(model, str(config.knob("deltakv_full_layers")))[2])

    @classmethod
    def sparse_held(cls, config) -> int:
        """The most cache indices a compressed sparse layer holds: sink + scratch + a raw
        tail of at most ``recent + FLUSH_TOKENS`` tokens (one more while a step's token
        waits for its flush)."""
        return config.sink_tokens + config.budget + config.recent_tokens + FLUSH_TOKENS + 1

    @classmethod
    def narrow_tokens(cls, config, model, prompt_tokens: int) -> int | None:
        total = config.sink_tokens + config.budget + config.recent_tokens
        return None if prompt_tokens <= total else cls.sparse_held(config)

    @classmethod
    def bytes_per_wide_page(cls, config, model, elem_bytes: int) -> int:
        """The codec's bytes for a page of history tokens in every sparse layer
        (``deltakv_bytes.stored_bytes_per_token`` of a max_model_len history)."""
        acct = stored_bytes_per_token(config.max_model_len or model.max_position_embeddings, model.num_kv_heads,
                                      model.head_dim, int(config.knob("deltakv_latent_dim")),
                                      float(config.knob("deltakv_center_ratio")), int(config.knob("deltakv_neighbors")),
                                      int(config.knob("deltakv_latent_bits")), elem_bytes)
        return math.ceil(acct.stored_per_token * config.page_size * len(cls.narrow_layers(config, model)))

    def narrow_bound(self, seq) -> int | None:
        st = self.cache.state(seq).get(STATE_KEY)
        return None if st is None or not st.compressed else self.sparse_held(self.config)

    def _pages_to_wide(self, seq) -> None:
        """After the first compression: the pages past what the sparse layers hold go to the
        pool's wide tier (a one-tier pool: nothing moves)."""
        bound = self.narrow_bound(seq)
        if bound is not None:
            self.cache.move_to_wide(seq, -(-bound // self.cache.page_size))
