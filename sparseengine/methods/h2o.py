"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
Large Language Models"): each cached token accumulates the attention probability it has
received from every query row so far (column sums emitted by the attention itself,
averaged over the query heads of its KV head). When a row exceeds the total, keep sink +
the last ``recent_tokens`` + the top-``budget`` others by accumulated score, carrying
their scores forward. Evicts at the end of prefill and every ``h2o_decode_interval``
decode steps.

Layout: the scores and each token's position live per cache slot in two token pools
beside the KV pool (``CacheManager.token_pool``), so they follow every token move. The
attention's column sums are added in place (a kernel, inside the decode CUDA graph); an
eviction picks its victims from the pools (``h2o_victims`` below) for every request
and layer of the step at once, and moves the kept tokens past the total into the freed
slots (``CacheManager.evict_to``): a decode step moves at most one token per (layer, KV
head), and a row's slots are in no particular token order.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from sparseengine import kernels
from sparseengine.engine.step_context import ScoreRows
from sparseengine.kernels.h2o_scores import h2o_scores_accumulate_torch
from sparseengine.method_registry import MethodSpec
from sparseengine.methods.base import SparseMethodRuntime

SCORES, POSITIONS = "h2o_scores", "h2o_positions"  # token pools
ROWS_PER_PICK = 1 << 24  # (layer, KV head, token) entries one batched victim pick reads at most


def h2o_victims(scores: torch.Tensor, positions: torch.Tensor, num_tokens: torch.Tensor,
                sink_tokens: int, recent_tokens: int, count: int) -> torch.Tensor:
    """``selection.h2o_keep`` for rows held in any slot order: the slots ``[..., count]`` (not
    sorted) whose tokens H2O evicts from rows ``scores [..., n]`` (accumulated, >= 0) whose
    slots hold the tokens at ``positions [..., n]`` (distinct per row). ``num_tokens [...]``:
    tokens the request has so far, so the last ``recent_tokens`` are the positions at or
    past ``num_tokens - recent_tokens``. The sink and those are never chosen; of the others,
    the lowest scores go, ties to the later token, which is exactly the complement of
    ``h2o_keep`` on the same row in token order (with ``count = n - total``). ``count``
    must not exceed the row's unprotected tokens."""
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a floating tensor, got dtype {scores.dtype}")
    if positions.shape != scores.shape or num_tokens.shape != scores.shape[:-1]:
        raise ValueError(f"positions must be {tuple(scores.shape)} and num_tokens {tuple(scores.shape[:-1])}, "
                         f"got {tuple(positions.shape)} and {tuple(num_tokens.shape)}")
    pos = positions.long()
    protected = (pos < sink_tokens) | (pos >= (num_tokens.long() - recent_tokens)[..., None])
    # one int64 key per token: score bits (order-preserving for floats >= 0, -0.0 folded
    # into 0.0) above the inverted position, so the smallest keys are the lowest scores
    # and, among equal scores, the later tokens
    scores = scores.float()
    bits = torch.where(scores > 0, scores, 0.0).view(torch.int32).long()
    key = (bits << 32) | ((1 << 31) - 1 - pos)
    key = key.masked_fill(protected, torch.iinfo(torch.int64).max)
    return key.topk(count, dim=-1, largest=False, sorted=False).indices


class H2O(SparseMethodRuntime):
    def __init__(self, config, model, cache) -> None:
        super().__init__(config, model, cache)
        self.interval = int(self.knob("h2o_decode_interval"))
        self._triton = False  # Triton kernels beside the provider (set at each observe)

    @classmethod
    def bytes_per_pool_page(cls, config, model, elem_bytes: int) -> int:
        return model.num_layers * config.page_size * model.num_kv_heads * (4 + 4)  # score + position

    def cache_lens_after_prefill(self, n: int) -> list[int]:
        return [min(n, self.total)] * self.model.num_layers

    def max_cache_tokens(self, n: int, output_tokens: int) -> int:
        return min(n + output_tokens, self.total + self.interval)

    def graph_capturable(self) -> bool:
        return True

    def metadata_bytes_read(self, seq, kv_bytes_per_token_layer: int) -> int:
        """Per cached token and KV head: its score read and written back (the column sums
        added), then its score and position read by the eviction."""
        return sum(seq.layer_lens) * self.model.num_kv_heads * (4 + 4 + 4 + 4)

    def _pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.cache.token_pool(SCORES, torch.float32),
                self.cache.token_pool(POSITIONS, torch.int32, fill=-1))

    # ---- scores: column sums added into the pools ----------------------------------------
    def score_rows(self, layer, ctx):
        if ctx.is_decode:  # one padded tensor of a static width: what a CUDA graph captures
            return ScoreRows(tuple(ctx.q_lens), max_kv_len=self.total + self.interval)
        return ScoreRows(tuple(ctx.q_lens))

    def observe(self, layer, q, colsums, ctx) -> None:
        view = ctx.views[layer]
        if isinstance(colsums, torch.Tensor):  # decode: [B, Hkv, M], one new token per row
            lens = torch.where(view.slot_mapping >= 0, view.kv_lens, 0)  # graph padding rows: none
            first, pos0 = lens - 1, ctx.positions
        else:
            width = max(c.shape[-1] for c in colsums)
            colsums = torch.stack([F.pad(c.float(), (0, width - c.shape[-1])) for c in colsums])
            lens = view.kv_lens
            first = lens - torch.tensor(ctx.q_lens, dtype=lens.dtype, device=lens.device)
            pos0 = ctx.positions[ctx.cu_q_lens[:-1].long()]
        scores, positions = self._pools()
        self._triton = ctx.provider.triton_kernels  # the eviction after the step uses the same kind
        add = kernels.h2o_scores_accumulate_triton if self._triton else h2o_scores_accumulate_torch
        add(scores[layer], positions[layer], colsums, view.page_table, lens, first, pos0)

    # ---- eviction ------------------------------------------------------------------------
    def finish_step(self, batch) -> None:
        ending, decoding = set(map(id, self.prefill_ending)), set(map(id, self.decoding))
        due = []
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
            if max(seq.layer_lens) > self.total:
                due.append(seq)
        if due:
            self.evict(due)

    def evict(self, seqs) -> None:
        """Every row back to the total, requests of one row length in one batched pick.
        Every layer of a request holds the same count (prefill, h2o_prefill's compaction
        and these evictions all treat the layers alike)."""
        groups: dict[int, list] = {}
        for seq in seqs:
            n = seq.layer_lens[0]
            if min(seq.layer_lens) != n or max(seq.layer_lens) != n:
                raise RuntimeError(f"h2o: request {seq.seq_id} holds {seq.layer_lens} tokens per layer, "
                                   "expected one count for every layer")
            groups.setdefault(n, []).append(seq)
        for n, group in groups.items():
            self._evict_rows(group, n)
        for seq in seqs:  # room for the tokens until the next eviction: no page churn
            seq.layer_lens = [self.total] * len(seq.layer_lens)
            self.cache.trim_pages(seq, room=min(seq.num_tokens, self.total + self.interval))

    def _evict_rows(self, seqs, n: int) -> None:
        """``n``-token rows of ``seqs`` down to the total, every layer (batched over both):
        one victim per row (a decode step) straight from the pools in one Triton kernel,
        more in gathered chunks of layers."""
        cfg, ps, total = self.config, self.cache.page_size, self.total
        scores, positions = self._pools()
        device, layers = scores.device, list(range(self.model.num_layers))
        pages = -(-n // ps)
        up = self.cache.upload
        table = up(np.array([s.page_table[:pages] for s in seqs], dtype=np.int64))
        tokens = up([s.num_computed_tokens for s in seqs])
        if n == total + 1 and self._triton:
            layers_t = up(layers)
            victims = kernels.h2o_victim_triton(scores, positions, table, layers_t, tokens, n, cfg.sink_tokens,
                                                cfg.recent_tokens)
            self.cache.evict_to(table, layers_t, victims[..., None], total)
            return
        idx = torch.arange(n, device=device)
        slots = table[:, idx // ps] * ps + idx % ps  # [G, n]
        step = max(1, ROWS_PER_PICK // max(1, len(seqs) * scores.shape[-1] * n))
        for i in range(0, len(layers), step):
            chunk = layers[i:i + step]
            flat = self.cache.flat(chunk, slots[None])  # [nl, G, n]
            s, p = (self.cache.rows(t)[flat].permute(1, 0, 3, 2) for t in (scores, positions))  # [G, nl, Hkv, n]
            victims = h2o_victims(s, p, tokens[:, None, None].expand(s.shape[:-1]), cfg.sink_tokens,
                                  cfg.recent_tokens, n - total)
            self.cache.evict_to(table, chunk, victims, total)

    # ---- decode benchmarks: the state a 128K prefill would leave --------------------------
    def init_synthetic(self, seq) -> None:
        """Random scores; positions: the sink, the middle spread evenly, the recent window."""
        scores, positions = self._pools()
        cfg, device = self.config, scores.device
        T = seq.num_computed_tokens
        for layer, n in enumerate(seq.layer_lens):
            if n >= T:
                pos = torch.arange(n)
            else:
                middle = n - cfg.sink_tokens - cfg.recent_tokens
                pos = torch.cat([torch.arange(cfg.sink_tokens),
                                 torch.linspace(cfg.sink_tokens, T - cfg.recent_tokens - 1, middle).long(),
                                 torch.arange(T - cfg.recent_tokens, T)])
            flat = self.cache.flat([layer], self.cache.slots(seq, torch.arange(n, device=device))[None])[0]
            self.cache.rows(scores)[flat] = torch.rand(n, scores.shape[-1], device=device)
            self.cache.rows(positions)[flat] = pos.to(device, torch.int32)[:, None].expand(-1, positions.shape[-1])


SPEC = MethodSpec(
    name="h2o", kind="decode", family="physical_eviction", runtime=H2O,
    prefill_policy="all_chunked", needs_scores=True, frees_memory=True,
    knobs={"h2o_decode_interval": 1},
    paper="Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs, NeurIPS 2023")
