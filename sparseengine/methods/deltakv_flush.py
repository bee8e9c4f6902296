"""DeltaKV's history flush (METHODS.md, deltakv): after a step, a request's raw tail tokens
older than its last ``recent_tokens`` move into the compressed history of every sparse layer.

The first flush (at the end of a long prefill, or when a decode first outgrows ``sink +
budget + recent``) encodes the whole history a layer at a time (``deltakv_codec.encode``:
that bounds the memory) into new ``deltakv_store.CodecStore`` buffers. Later flushes wait
until the tail holds ``FLUSH_TOKENS`` tokens past the recent ones (amortising the
compaction; those tokens stay exact meanwhile), then encode them for every sparse layer at
once (``deltakv_codec.encode_tail_layers``, whose nearest-center search reads the stored
centers where they are) and append them in place (``deltakv_store.append_layers``). Either
way the sink and scratch slots stay where they are and the raw tail left moves down behind
them (``CacheManager.compact_tokens``); ``hist_end`` moves on (on the device too: a
captured step reads it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparseengine.methods import deltakv_codec as codec
from sparseengine.methods.deltakv_store import append_layers, same_history

if TYPE_CHECKING:
    from sparseengine.methods.deltakv import DeltaKV

# Raw tail tokens beyond recent_tokens before they are moved into the compressed history.
FLUSH_TOKENS = 64


def flush_history(rt: DeltaKV, seq) -> None:
    """Move ``seq``'s raw tail tokens older than the last ``recent_tokens`` into the history
    of ``rt``'s sparse layers, when there are enough of them (module docstring)."""
    cfg = rt.config
    sink, budget, recent = cfg.sink_tokens, cfg.budget, cfg.recent_tokens
    length = seq.num_computed_tokens
    if length <= rt.total or not rt.sparse:
        return
    st = rt._state(seq)
    end = length - recent
    if end <= st.hist_end or (st.compressed and end - st.hist_end < FLUSH_TOKENS):
        return
    first = not st.compressed
    base = sink if first else sink + budget
    count, held = end - st.hist_end, base + length - st.hist_end
    positions = torch.arange(st.hist_end, end, device=rt.device)
    slots = rt.cache.slots(seq, torch.arange(base, base + count, device=rt.device))  # same in every layer
    for layer in rt.sparse:
        if seq.layer_lens[layer] != held:
            raise RuntimeError(f"deltakv: layer {layer} holds {seq.layer_lens[layer]} tokens, expected {held}")
    if st.compressed:  # every sparse layer at once: a few batched ops, not a round of small ones per layer
        stores, checks = [st.stores[layer] for layer in rt.sparse], []
        new = codec.encode_tail_layers([s.centers[: s.c] for s in stores], same_history(stores),
                                       tail_kv(rt, rt.sparse, slots, positions), rt.down_stack, rt.stride,
                                       rt.neighbors, rt.bits, defer=checks)
        append_layers(stores, count, *new)
        st.defer(checks)  # the overflow check, read at a later flush or when the request ends
    else:  # the first flush moves the whole prompt's history: a layer at a time bounds the memory
        for layer in rt.sparse:
            store = st.stores[layer] = rt._new_store(seq, layer)
            store.write(codec.encode(tail_kv(rt, [layer], slots, positions)[0], rt.down[layer],
                                     center_ratio=rt.ratio, neighbors=rt.neighbors, latent_bits=rt.bits))
    rt.cache.compact_tokens(seq, torch.arange(base + count, held, device=rt.device), rt.sparse, sink + budget)
    rt._set_hist_end(st, end)
    rt.cache.trim_pages(seq)
    if first:
        rt._pages_to_wide(seq)


def tail_kv(rt: DeltaKV, layers: list[int], slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[len(layers), n, D]``: the cached tokens at ``slots`` (positions ``positions``) of
    those layers as codec vectors, keys unrotated."""
    cache = rt.cache
    rows = cache.flat(layers, slots[None])  # [nl, n]
    k = cache.kv.k_rows[rows].flatten(0, 1)
    v = cache.kv.v_rows[rows].flatten(0, 1)
    k = codec.unrotate_keys(k, positions.repeat(len(layers)), rt.inv_freq).to(k.dtype)
    return codec.concat_kv(k, v).view(len(layers), slots.shape[0], -1)
