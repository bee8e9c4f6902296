"""Where a chosen token sits in a DeltaKV sparse layer's paged cache.

A compressed sparse layer's cache is laid out as

    [ sink: S raw | scratch: B slots | raw tail: tokens hist_end .. L-1 ]

(S = sink_tokens, B = budget): the tokens S .. hist_end-1 (the history) live only in the
codec and are rebuilt into the scratch slots when chosen. `map_chosen` maps a decode
step's chosen tokens onto that layout, on the device, with no host sync.
"""

from __future__ import annotations

import torch


def map_chosen(tokens: torch.Tensor, counts: torch.Tensor, hist_end: torch.Tensor, table: torch.Tensor, sink: int,
               budget: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(idx, slots, positions)``, each ``[B, K]``, of ``tokens [B, K]`` (each row's first
    ``counts[b]`` chosen, ascending), ``hist_end [B, 1]`` (-1: the row is not compressed)
    and the rows' page ``table [B, P]``: cache indices (sink tokens in place, raw tail
    tokens at their slots past the scratch, history tokens in the scratch slots in order:
    at most ``budget`` of them, as they all lie in the full layer's top-``budget`` range,
    ``hist_end <= length - recent``); the cache slot each history token is rebuilt into
    (-1: none); and the codec-safe position of every entry. Uncompressed rows map to
    themselves."""
    compressed = hist_end >= 0
    counted = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < counts[:, None]
    raw = tokens >= hist_end
    hist = compressed & counted & (tokens >= sink) & ~raw
    scratch = sink + torch.cumsum(hist, 1) - 1
    mapped = torch.where(raw, sink + budget + tokens - hist_end, torch.where(hist, scratch, tokens))
    idx = torch.where(compressed, mapped, tokens)
    at = scratch.clamp(0, table.shape[1] * page_size - 1)
    pages = table.gather(1, at // page_size).long()
    slots = torch.where(hist, pages * page_size + at % page_size, -1)
    return idx, slots, torch.minimum(tokens.clamp(min=sink), (hist_end - 1).clamp(min=sink))
