"""How many KV pages the pool holds, and how many of them every layer stores.

A method whose compressed layers keep only a request's first few cache indices while its
other layers keep every token (DeltaKV: sparse layers ~2K tokens, full layers all 128K)
wastes most of a one-tier pool: a page there is as large in every layer, so the full
layers' pages pin the sparse layers' memory too. ``plan_pool`` then splits the pool:
*narrow* pages (every layer) for what a compressed request's narrow layers hold and for
one prompt held whole until it is compressed, *wide* pages (the wide layers only, plus the
method's memory per token outside the pool, e.g. DeltaKV's codec) for the rest. It sizes
the tiers for requests of ``max_model_len`` tokens (``kv_pool_tier_tokens`` where set), and
keeps one tier where two would not fit more of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseengine.config import ConfigError
from sparseengine.engine.kv_cache import page_bytes


@dataclass(frozen=True)
class PoolPlan:
    num_pages: int
    narrow_pages: int  # page ids below it hold every layer; the rest, the wide layers only
    narrow_layers: tuple[int, ...] = ()
    requests: int | None = None  # requests of the planned length the tiers hold (None: one tier)
    one_tier_pages: int | None = None  # what one tier would hold in the same budget (None: num_pages)

    @property
    def tiered(self) -> bool:
        return self.narrow_pages < self.num_pages


def plan_pool(budget: float, page_all: int, page_wide: int, narrow_layers: tuple[int, ...],
              request_pages: int, narrow_request_pages: int) -> PoolPlan:
    """``budget`` bytes for the pool; ``page_all``: bytes of a page in every layer (with the
    method's state per page); ``page_wide``: bytes of a page in the wide layers only (with
    the method's memory per page outside the pool); ``request_pages``: pages of a request
    of the planned length (``plan_for``), ``narrow_request_pages`` of which its narrow
    layers hold once compressed.

    Two tiers hold one such prompt whole (narrow) and ``b`` compressed requests beside it
    (each ``narrow_request_pages`` narrow and the rest wide), ``b`` as large as the budget
    allows; bytes left over become narrow pages. One tier: ``budget // page_all`` pages."""
    one = int(budget // page_all)
    uniform = PoolPlan(one, one)
    wide_pages = request_pages - narrow_request_pages
    if not narrow_layers or wide_pages <= 0 or page_wide >= page_all:
        return uniform
    per_request = narrow_request_pages * page_all + wide_pages * page_wide
    b = int((budget - request_pages * page_all) // per_request)
    if b + 1 <= one // request_pages:  # two tiers would hold no more whole requests
        return uniform
    narrow = request_pages + b * narrow_request_pages
    wide = b * wide_pages
    narrow += int((budget - narrow * page_all - wide * page_wide) // page_all)
    return PoolPlan(narrow + wide, narrow, tuple(sorted(narrow_layers)), b + 1, one)


def plan_for(runtime, config, model, dtype: torch.dtype, budget: float, max_model_len: int) -> PoolPlan:
    """``plan_pool`` for a method runtime class (its ``bytes_per_pool_page``,
    ``narrow_layers``, ``narrow_tokens``, ``bytes_per_wide_page``) and the engine's config
    (``page_size``; ``kv_pool_tiers="off"``: one tier; ``kv_pool_tier_tokens``: the requests'
    length, prompt and output, the tiers are sized for: at most ``max_model_len``, the default)."""
    tokens = config.kv_pool_tier_tokens or max_model_len
    if tokens > max_model_len:
        raise ConfigError(f"kv_pool_tier_tokens={tokens} is longer than max_model_len={max_model_len}: "
                          "the tiers are sized for prompts the engine admits")
    elem = torch.empty((), dtype=dtype).element_size()
    extra = runtime.bytes_per_pool_page(config, model, elem)
    narrow = tuple(runtime.narrow_layers(config, model)) if config.kv_pool_tiers == "auto" else ()
    held = runtime.narrow_tokens(config, model, tokens) if narrow else None
    ps = config.page_size
    page_all = page_bytes(model, ps, dtype) + extra
    page_wide = (page_bytes(model, ps, dtype, model.num_layers - len(narrow)) + extra
                 + runtime.bytes_per_wide_page(config, model, elem))
    request = -(-tokens // ps)
    return plan_pool(budget, page_all, page_wide, narrow, request, request if held is None else -(-held // ps))
