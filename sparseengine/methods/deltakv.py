"""DeltaKV (Hao et al., 2026, "DeltaKV: Residual-Based KV Cache Compression via Long-Range
Similarity"; METHODS.md, "deltakv"): hybrid residual compression + OmniKV-style selection.

Layers. ``deltakv_full_layers`` (empty: the per-model table, the same one as OmniKV's
filter layers, whose role they play) keep their whole KV, attend densely and, at each
decode step, choose one token set as OmniKV does (``omnikv_token_scores`` /
``omnikv_select``, ``logits`` scores): sink + top-``budget`` + the last ``recent_tokens``.
Layers before the first full layer have no choice to follow, so they stay dense and keep
their whole KV too. Every other layer is *sparse*.

Sparse layers, per request, once it holds more than ``sink + budget + recent`` tokens (at
the end of prefill, or later during decode). Their paged cache is laid out as
``deltakv_layout`` describes (sink, scratch slots, raw tail), and the tokens ``S ..
hist_end-1`` (the *history*) live only in the codec (``deltakv_codec``) in the
per-request state: centers (every ``round(1/ratio)``-th history
token, raw, pre-RoPE), neighbour indices and ``Down``-projected residual latents (int4 or
float16). Keys are stored rotated in the cache; they are un-rotated (rotation by the
negative position, exact up to float error) before encoding. The codec's positions count
from the first history token (codec position j = token S + j), and so does calibration.

Decode. The full layers choose (in pure-decode steps from their own attention's max
logits, ``ScoreRows(kind="max_logits")``, with no host sync on the way; in mixed steps
per request); each sparse layer maps the chosen tokens onto its cache:
sink and raw-tail tokens are read in place, history tokens are rebuilt
(``Up(z) + mean of the same centers``, RoPE re-applied at the token's original position)
into the scratch slots (on a Triton provider by one fused kernel per layer for the whole
batch, ``kernels.deltakv_rebuild_batched_triton``, which reads only the history entries; per
request in mixed steps), and the Selection
covers sink + scratch + raw tail picks. The raw tail grows by one token per step; when it
holds ``deltakv_flush.FLUSH_TOKENS`` more than ``recent_tokens``, its oldest tokens are
appended to the history (``deltakv_flush``: every sparse layer's encoded at once and
appended in place to each layer's ``deltakv_store.CodecStore``) and the layer is compacted
back to ``S + B + R`` slots.
Raw tail tokens older than the last ``recent_tokens`` that the full layers choose are read
exact (never worse than rebuilding them).

Memory. ``deltakv_pool``: the layers' roles, and the request's place in the two-tier KV
pool. :meth:`DeltaKV.stored_bytes` reports what the request really keeps (full layers + raw
sink/scratch/tail of sparse layers + centers + latents + neighbour indices) against dense,
from the codec's used rows, and the pool bytes its page table pins (codec buffers are
sized for prompt + max_tokens: a request that stops early holds more than it used).
CUDA graphs: pure-decode steps are captured per batch of requests (``graph_key``); the
flushes between replays need no recapture.

With ``budget`` covering the prompt (and the outputs) nothing is ever compressed: the
method is exactly dense.

Checkpoint. ``Down``/``Up`` per layer from ``deltakv_checkpoint_path`` (safetensors,
``deltakv_fit.save_checkpoint``), written by
``python -m sparseengine.methods.deltakv_calibrate``. Its model, center ratio and neighbour
count must match; ``deltakv_latent_dim`` may be smaller than the checkpoint's (PCA
components are ordered, so the first r columns are the best rank-r pair).
"""

from __future__ import annotations

import torch

from sparseengine import kernels
from sparseengine.config import ConfigError
from sparseengine.engine.step_context import Selection
from sparseengine.kernels import deltakv_rebuild
from sparseengine.layers.rotary import rope_inv_freq
from sparseengine.method_registry import MethodSpec
from sparseengine.methods import deltakv_codec as codec
from sparseengine.methods.deltakv_bytes import DeltaKVBytes, rebuild_read_bytes, request_bytes
from sparseengine.methods.deltakv_fit import load_down_up
from sparseengine.methods.deltakv_layout import map_chosen
from sparseengine.methods.deltakv_flush import flush_history
# FULL_LAYERS: importable from here too
from sparseengine.methods.deltakv_pool import FULL_LAYERS, DeltaKVPool, layer_roles  # noqa: F401
from sparseengine.methods.deltakv_store import STATE_KEY, CodecStore, RequestState
from sparseengine.methods import omnikv
from sparseengine.methods.omnikv import choose_tokens


class DeltaKV(DeltaKVPool):
    def __init__(self, config, model, cache) -> None:
        super().__init__(config, model, cache)
        self.filters, self.full, self.sparse = layer_roles(model, str(self.knob("deltakv_full_layers")))
        self.filter_set, self.sparse_set = set(self.filters), set(self.sparse)
        self.sparse_index = {layer: i for i, layer in enumerate(self.sparse)}
        try:
            self.ratio = float(self.knob("deltakv_center_ratio"))
            self.stride = codec.center_stride(self.ratio)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"Invalid deltakv_center_ratio: {e}") from None
        self.neighbors = int(self.knob("deltakv_neighbors"))
        if self.neighbors < 1:
            raise ConfigError(f"Invalid deltakv_neighbors={self.neighbors}: must be >= 1")
        self.bits = int(self.knob("deltakv_latent_bits"))
        if self.bits not in codec.LATENT_BITS:
            valid = ", ".join(map(str, codec.LATENT_BITS))
            raise ConfigError(f"Invalid deltakv_latent_bits={self.bits}: valid: {valid}")
        self.latent_dim = int(self.knob("deltakv_latent_dim"))
        if self.latent_dim < 1 or (self.bits == 4 and self.latent_dim % codec.QUANT_GROUP):
            raise ConfigError(f"Invalid deltakv_latent_dim={self.latent_dim}: must be a positive multiple of "
                              f"{codec.QUANT_GROUP} with deltakv_latent_bits=4")
        self.device = cache.kv.device
        self.path = str(self.knob("deltakv_checkpoint_path"))
        self.down, self.up, self.checkpoint_meta = load_down_up(
            self.path, model, self.sparse, ratio=self.ratio, stride=self.stride, neighbors=self.neighbors,
            latent_dim=self.latent_dim, device=self.device)
        self.up = {layer: up.float() for layer, up in self.up.items()}  # the torch rebuild's product: float32
        # one float32 stack (the flushes encode every sparse layer at once); each layer's Down is a view of it
        self.down_stack = torch.stack([self.down[layer].float() for layer in self.sparse]) if self.sparse else None
        self.down = {layer: self.down_stack[i] for i, layer in enumerate(self.sparse)}
        # the fused rebuild's: float16 on tensor cores for a 16-bit cache, float32 (exact) for a float32 one
        exact = cache.kv.dtype == torch.float32
        self.up_dot = self.up if exact else {layer: up.half() for layer, up in self.up.items()}
        self.inv_freq = rope_inv_freq(model.head_dim, model.rope_theta, model.rope_scaling).float().to(self.device)
        self.token_bytes = 2 * model.num_kv_heads * model.head_dim * cache.kv.k_rows.element_size()
        self.bytes_at_end: dict[int, DeltaKVBytes] = {}  # seq_id -> stored_bytes when it finished
        self._chosen: list[torch.Tensor | None] | None = None  # mixed steps: per request
        self._picked: tuple[torch.Tensor, torch.Tensor] | None = None  # pure decode: (tokens [B, K], counts [B])
        self._mapped: tuple[torch.Tensor, ...] | None = None  # pure decode: _map of the pick
        self._addresses: torch.Tensor | None = None  # pure decode: the rows' codec addresses
        self._no_history = torch.tensor(-1, dtype=torch.long, device=self.device)  # rows not compressed
        self._no_codec = torch.zeros(len(self.sparse), 5, dtype=torch.int64, device=self.device)  # their addresses

    # ---- engine hooks (the pool's: deltakv_pool) ------------------------------------------
    def cache_lens_after_prefill(self, prompt_tokens: int) -> list[int]:
        cfg = self.config
        if prompt_tokens <= self.total:
            return [prompt_tokens] * self.model.num_layers
        return [cfg.sink_tokens + cfg.budget + cfg.recent_tokens if layer in self.sparse_set else prompt_tokens
                for layer in range(self.model.num_layers)]

    def init_synthetic(self, seq) -> None:
        """A synthesised prefill (decode benchmarks): random codec state of the right shapes
        and sizes for the history a real prefill would have compressed."""
        cfg, n = self.config, seq.num_prompt_tokens
        if n <= self.total or not self.sparse:
            return
        st = self._state(seq)
        hist = n - cfg.sink_tokens - cfg.recent_tokens
        gen = torch.Generator(device=self.device).manual_seed(cfg.seed + seq.seq_id)
        for layer in self.sparse:
            st.stores[layer] = self._new_store(seq, layer)
            st.stores[layer].write_random(hist, gen)
        self._set_hist_end(st, n - cfg.recent_tokens)
        self._pages_to_wide(seq)

    def _new_store(self, seq, layer: int) -> CodecStore:
        """Buffers for the longest history the request can reach; their addresses kept in the
        layer's row of the request's table (the batched rebuild's)."""
        cfg = self.config
        tokens = seq.num_prompt_tokens + seq.sampling_params.max_tokens
        dim = 2 * self.model.num_kv_heads * self.model.head_dim
        row = self._state(seq).address_row(self.sparse_index[layer], len(self.sparse), self.device)
        return CodecStore(tokens - cfg.sink_tokens - cfg.recent_tokens, self.stride, self.bits, self.neighbors, dim,
                          self.latent_dim, self.cache.kv.dtype, self.device, addresses=row)

    @torch.inference_mode()  # made under the runner's inference mode (a synthesised prefill) or not
    def _set_hist_end(self, st: RequestState, end: int) -> None:
        st.hist_end = end
        if st.hist_end_t is None:
            st.hist_end_t = torch.tensor(end, dtype=torch.long, device=self.device)
        else:
            st.hist_end_t.fill_(end)

    def kernels(self, device, provider) -> dict[str, str]:
        return {"omnikv_select": omnikv.pick_kernel(device, provider)}

    def tokens_read(self, seq) -> list[int]:
        return [n if layer not in self.sparse_set else min(n, self.total) for layer, n in enumerate(seq.layer_lens)]

    def metadata_bytes_read(self, seq, kv_bytes_per_token_layer: int) -> int:
        """Per decode step (the pure-decode path, Triton provider): each full layer's fused
        max-logit scores (``omnikv.max_logit_bytes_per_token``) and, per sparse layer, what
        the rebuild reads (``deltakv_bytes.rebuild_read_bytes``)."""
        scores = sum(seq.layer_lens[layer] for layer in self.filters)
        total = scores * omnikv.max_logit_bytes_per_token(self.model.num_kv_heads, self.device)
        st = self.cache.state(seq).get(STATE_KEY)
        if st is None or not st.compressed:
            return total
        return total + rebuild_read_bytes(list(st.enc.values()), self.config.budget, kv_bytes_per_token_layer)

    def begin_step(self, ctx) -> None:
        super().begin_step(ctx)
        self._chosen = self._picked = self._mapped = None

    def begin_step_graph(self, seqs) -> None:
        super().begin_step_graph(seqs)
        self._chosen = self._picked = self._mapped = None

    def graph_key(self, seqs):
        """A pure-decode step bakes in, per request, whether its layers are compressed and
        which codec buffers they read (everything else it reads is a device tensor that
        the flushes update in place): a graph captured for these requests replays until
        one of them changes that."""
        return tuple((s.seq_id, *self._state(s).graph_state()) for s in seqs)

    def select(self, layer, q, ctx):
        if layer < self.filters[0] or not self.decoding:
            return None
        batched = omnikv.pure_decode(ctx)
        if layer in self.filter_set:
            if not batched:  # pure decode: observe() takes the choice from the attention's max logits
                self._chosen = self._choose(layer, q, ctx)
            return None  # full layers attend densely
        if layer not in self.sparse_set:
            return None
        if batched:
            return None if self._picked is None else self._batched_selection(layer, ctx)
        if self._chosen is None or all(c is None for c in self._chosen):
            return None
        table = ctx.views[layer].page_table
        per_request = [None if c is None else self._mapped_row(seq, layer, c, table[b:b + 1], ctx)
                       for b, (seq, c) in enumerate(zip(ctx.seqs, self._chosen))]
        return Selection.from_lists(per_request, self.model.num_kv_heads, q.device)

    def _mapped_row(self, seq, layer: int, chosen: torch.Tensor, table: torch.Tensor, ctx) -> torch.Tensor:
        """Mixed steps: one request's chosen tokens (any count) mapped onto the layer's
        cache, its history tokens rebuilt."""
        count = torch.full((1,), chosen.numel(), dtype=torch.long, device=chosen.device)
        idx, slots, positions = self._map([seq], chosen[None], count, table)
        if self._state(seq).compressed:
            self._rebuild_into(seq, layer, positions[0], slots[0], ctx)
        return idx[0]

    def score_rows(self, layer, ctx):
        """Pure decode: a full layer's dense attention reports every token's max logit per
        KV head (OmniKV's fused scores), so choosing reads no K a second time."""
        if layer in self.filter_set and self.decoding and omnikv.pure_decode(ctx):
            return omnikv.max_logit_rows(layer, ctx)
        return None

    def observe(self, layer, q, colsums, ctx):
        self._picked = omnikv.pick_from_max_logits(colsums, ctx.views[layer].kv_lens, self.config,
                                                   ctx.provider.triton_kernels)
        self._mapped = None

    def _batched_selection(self, layer, ctx) -> Selection:
        """Pure decode: every request's chosen tokens mapped onto this sparse layer's cache
        (history tokens rebuilt into the scratch slots), with no host sync: fixed width
        ``sink + budget + recent``, the counts from the full layer's pick. The mapping is
        the same for every sparse layer reading one pick (one page table for all layers)."""
        tokens, counts = self._picked
        if self._mapped is None:  # once a step: every sparse layer maps the same pick the same way
            self._mapped = self._map(ctx.seqs, tokens, counts, ctx.views[layer].page_table)
            self._addresses = torch.stack([self._state(s).addresses if self._held(s) else self._no_codec
                                           for s in ctx.seqs])  # [B, sparse layers, 5]
        idx, slots, positions = self._mapped
        self._rebuild_rows(layer, positions, slots, ctx)
        B, width, hkv = tokens.shape[0], tokens.shape[1], self.model.num_kv_heads
        return Selection(idx[:, None, :].expand(B, hkv, width), counts[:, None].expand(B, hkv),  # views: no launch
                         dense=(False,) * B)

    def _map(self, seqs, tokens: torch.Tensor, counts: torch.Tensor, table: torch.Tensor):
        """``deltakv_layout.map_chosen`` of these requests' chosen tokens (rows of requests
        not compressed, or None, map to themselves)."""
        ends = [self._state(s).hist_end_t if self._held(s) else self._no_history for s in seqs]
        hist_end = torch.stack(ends)[:, None]  # [B, 1]: the flushes move it on the device
        return map_chosen(tokens, counts, hist_end, table, self.config.sink_tokens, self.config.budget,
                          self.cache.page_size)

    def _held(self, seq) -> bool:
        """A real row (not a captured graph's padding, None) whose sparse layers are compressed."""
        return seq is not None and self._state(seq).compressed

    def _rebuild_rows(self, layer: int, positions: torch.Tensor, slots: torch.Tensor, ctx) -> None:
        """Pure decode: every compressed row's history entries of this layer rebuilt, on a
        Triton provider in one launch (``kernels.deltakv_rebuild_batched_triton``, the codecs
        found through this step's address table) unless the rows' codecs differ in index
        dtype (a history past 32767 centers beside a shorter one)."""
        seqs = ctx.seqs
        encs = [self._state(s).stores[layer].full() if self._held(s) else None for s in seqs]
        rows = [b for b, enc in enumerate(encs) if enc is not None]
        one_launch = ctx.provider.triton_kernels and deltakv_rebuild.ONE_LAUNCH_PER_LAYER
        if rows and one_launch and len({encs[b].neighbors.dtype for b in rows}) == 1:
            k_cache, v_cache = ctx.kv_cache.layer(layer)
            kernels.deltakv_rebuild_batched_triton(encs, self.up_dot[layer], self.inv_freq, positions, slots, k_cache,
                                                   v_cache, self.config.sink_tokens,
                                                   addresses=self._addresses[:, self.sparse_index[layer]])
            return
        for b in rows:
            self._rebuild_into(seqs[b], layer, positions[b], slots[b], ctx)

    def _rebuild_into(self, seq, layer: int, positions: torch.Tensor, slots: torch.Tensor, ctx) -> None:
        """Rebuild the history tokens at ``positions`` into this layer's cache at ``slots``
        (entries with slot -1 skipped): the fused Triton kernel on a Triton provider, else
        the codec's torch path (which rebuilds every entry, then writes the named ones)."""
        k_cache, v_cache = ctx.kv_cache.layer(layer)
        if ctx.provider.triton_kernels:
            enc = self._state(seq).stores[layer].full()
            kernels.deltakv_rebuild_triton(enc, self.up_dot[layer], self.inv_freq, positions, slots, k_cache, v_cache,
                                           self.config.sink_tokens)
        else:
            k, v = self.rebuild(seq, layer, positions)
            ctx.provider.write_kv(k_cache, v_cache, k, v, slots)

    def _choose(self, layer, q, ctx) -> list[torch.Tensor | None]:
        """OmniKV's choice at a full layer: token positions (== its cache indices)."""
        return choose_tokens(self, layer, q, ctx, "logits")

    def _state(self, seq) -> RequestState:
        st = self.cache.state(seq)
        if STATE_KEY not in st:
            st[STATE_KEY] = RequestState(hist_end=self.config.sink_tokens)
        return st[STATE_KEY]

    def rebuild(self, seq, layer: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated at each token's position) and V ``[m, Hkv, d]`` float32 of history
        tokens ``tokens`` (the caller keeps their positions in ``[sink, hist_end)``; nothing
        waits on the device) from the layer's codec. It reads the whole buffers: a captured
        step's gathers never see their shapes change."""
        st = self._state(seq)
        kv = codec.decode_at(st.stores[layer].full(), self.up[layer], tokens.long() - self.config.sink_tokens)
        k, v = codec.split_kv(kv, self.model.num_kv_heads, self.model.head_dim)
        return codec.rotate_keys(k, tokens, self.inv_freq), v

    def finish_step(self, batch) -> None:
        for seq in self.prefill_ending + self.decoding:
            self._flush(seq)

    def release(self, seq) -> None:
        """A request that ends (or is preempted): its flushes' overflow checks are read now."""
        st = self.cache.state(seq).get(STATE_KEY)
        if st is not None:
            st.settle(wait=True)

    def _flush(self, seq) -> None:
        """Move raw tail tokens older than the last ``recent_tokens`` into the history
        (``deltakv_flush``)."""
        flush_history(self, seq)

    # ---- accounting -----------------------------------------------------------------------
    def stored_bytes(self, seq) -> DeltaKVBytes:
        """What this request keeps now (see :class:`DeltaKVBytes`)."""
        st = self.cache.state(seq).get(STATE_KEY)
        return request_bytes(list(seq.layer_lens), list(st.enc.values()) if st is not None else [], self.full,
                             self.sparse, self.model.num_layers, self.token_bytes,
                             len(seq.page_table) * self.cache.page_size)

    def kv_tokens(self, seq) -> float:
        if len(self.bytes_at_end) >= 1024:
            self.bytes_at_end.pop(next(iter(self.bytes_at_end)))
        self.bytes_at_end[seq.seq_id] = self.stored_bytes(seq)
        return super().kv_tokens(seq)


SPEC = MethodSpec(
    name="deltakv", kind="decode", family="hybrid_compression", runtime=DeltaKV,
    prefill_policy="long_bs1full_short_batch", frees_memory=True,
    knobs={"deltakv_full_layers": "", "deltakv_center_ratio": 0.1, "deltakv_neighbors": 4,
           "deltakv_latent_dim": 256, "deltakv_latent_bits": 4, "deltakv_checkpoint_path": ""},
    paper="Hao et al., DeltaKV: Residual-Based KV Cache Compression via Long-Range Similarity, "
          "arXiv 2602.08005, 2026")
