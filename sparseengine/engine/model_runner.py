"""Turns a scheduled batch into tensors, runs the model once, returns the logits to sample."""

from __future__ import annotations

import numpy as np
import torch

from sparseengine.engine.scheduler import ScheduledBatch
from sparseengine.engine.sequence import Sequence
from sparseengine.engine.cuda_graphs import DecodeGraphs
from sparseengine.engine.inflight import Feed
from sparseengine.engine.step_context import LayerView, StepContext, set_step_context
from sparseengine.engine.teacher_forcing import AttentionCapture


class ModelRunner:
    def __init__(self, model, kv_cache, provider, method, device: torch.device, page_size: int,
                 graphs: "DecodeGraphs | None" = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.provider = provider
        self.method = method
        self.device = device
        self.page_size = page_size
        self.num_layers = model.config.num_layers
        self.graphs = graphs
        self.graph_steps = 0
        # while set (``LLM.teacher_forced``): every step runs eagerly and tells it its sampled rows
        self.capture: AttentionCapture | None = None

    def _graph_decode(self, seqs: list[Sequence], ids: list[int], pos: list[int], key=None,
                      feed: Feed | None = None) -> torch.Tensor:
        ps = self.page_size
        starts = np.array([s.layer_lens for s in seqs], dtype=np.int64).T  # [L, B]
        table = self.graphs.page_tables([s.seq_id for s in seqs], [s.page_table for s in seqs])
        pages = table[np.arange(len(seqs))[None, :], starts // ps]  # [L, B]
        slots = pages.astype(np.int64) * ps + starts % ps
        self.graph_steps += 1
        return self.graphs.run(ids, pos, slots, (starts + 1).astype(np.int32), seqs=seqs, key=key, feed=feed)

    def _views(self, seqs: list[Sequence], q_lens: list[int]) -> list[LayerView]:
        ps = self.page_size
        max_pages = max(len(s.page_table) for s in seqs)
        table = np.zeros((len(seqs), max_pages), dtype=np.int32)
        for b, s in enumerate(seqs):
            table[b, : len(s.page_table)] = s.page_table
        table_t = torch.from_numpy(table).to(self.device)
        by_lens: dict[tuple[int, ...], LayerView] = {}
        views = []
        for layer in range(self.num_layers):
            starts = tuple(s.layer_lens[layer] for s in seqs)
            view = by_lens.get(starts)
            if view is None:
                slots = []
                for b, (start, n) in enumerate(zip(starts, q_lens)):
                    pos = np.arange(start, start + n)
                    slots.append(table[b, pos // ps].astype(np.int64) * ps + pos % ps)
                lens = tuple(st + n for st, n in zip(starts, q_lens))
                view = LayerView(
                    slot_mapping=torch.from_numpy(np.concatenate(slots)).to(self.device),
                    kv_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
                    kv_lens_list=lens,
                    page_table=table_t,
                )
                by_lens[starts] = view
            views.append(view)
        return views

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, feed: Feed | None = None) -> tuple[list[Sequence], torch.Tensor | None]:
        """``feed``: the batch's rows whose input token the previous step sampled on the
        device and the host has not read (their ids here are placeholders)."""
        seqs, q_lens = batch.seqs, batch.num_new_tokens
        ids, pos, sample_rows, sample_seqs = [], [], [], []
        offset = 0
        for seq, n in zip(seqs, q_lens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_slice(start, n))
            pos.extend(self.method.positions(seq, start, n))
            offset += n
            if start + n == seq.num_tokens:
                sample_rows.append(offset - 1)
                sample_seqs.append(seq)
        if feed is not None:  # their placeholders as a valid id until the device writes the token
            for r in feed.rows:
                ids[r] = 0
        key = None
        graphs = self.graphs if self.capture is None else None
        capturable = not self.method.wants_forward_hooks(seqs) or self.method.graph_capturable()
        if not capturable and graphs is not None and batch.is_pure_decode:
            key = self.method.graph_key(seqs)  # a graph for these requests' state, or eager
            capturable = key is not None
        if (graphs is not None and batch.is_pure_decode and capturable
                and graphs.bucket(len(seqs)) is not None and graphs.fits(seqs)):
            self.method.begin_step_graph(seqs)
            return seqs, self._graph_decode(seqs, ids, pos, key, feed)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        ctx = StepContext(
            seqs=seqs, q_lens=tuple(q_lens), cu_q_lens=cu, is_decode=all(n == 1 for n in q_lens),
            views=self._views(seqs, q_lens), kv_cache=self.kv_cache, provider=self.provider,
            method=self.method, positions=positions,
        )
        self.method.begin_step(ctx)
        set_step_context(ctx)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        if feed is not None:
            feed.apply(ids_t)
        if self.capture is not None:
            self.capture.select(sample_rows, self.device)
        try:
            hidden = self.model(ids_t, positions)
        finally:
            set_step_context(None)
        offset = 0
        for seq, n in zip(seqs, q_lens):  # requests that asked for their prompt positions' logits
            if seq.prompt_logits is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                upto = min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
                start = min(upto, max(0, seq.prompt_logits_from - seq.num_computed_tokens))
                if start < upto:
                    rows_h = hidden[offset + start:offset + upto]
                    seq.prompt_logits.append(self.model.compute_logits(rows_h).to("cpu", torch.float32))
            offset += n
        if not sample_rows:
            return [], None
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return sample_seqs, self.model.compute_logits(hidden[rows])
