"""Continuous batching: who runs which tokens this step. Plain Python, no torch.

A step mixes decodes (one token each) and prefill chunks. Decodes of running requests go
first, then running requests still in prefill, then waiting requests, within
``max_num_seqs`` and ``max_num_batched_tokens``. When the KV pool cannot hold a running
request's next tokens, the newest other running request is preempted by recompute: its
pages return to the pool and it goes back to the front of the waiting queue.

A pool with narrow layers (``KVCache``, ``PageAllocator``) takes from ``narrow_bound`` how
far a request's narrow layers may reach: its logical pages below that bound come from the
narrow tier, the rest from the wide one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from sparseengine.engine.page_allocator import PageAllocator
from sparseengine.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_pure_decode(self) -> bool:
        return bool(self.seqs) and all(s.is_decoding for s in self.seqs)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_size: int
    page_size: int
    max_model_len: int
    prefill_policy: str = "all_chunked"
    long_prefill_threshold: int = 65536


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # cache indices below which a request's narrow layers may hold tokens (None: all);
        # set by the engine from its method (``narrow_bound``)
        self.narrow_bound: Callable[[Sequence], int | None] = lambda seq: None

    # ---- admission -------------------------------------------------------------------
    def validate(self, seq: Sequence, cache_tokens: int | None = None) -> str | None:
        """The reason this request cannot run at all, or None. ``cache_tokens``: the most
        cache slots the prompt needs (less than its length for methods that compact
        during prefill)."""
        n = seq.num_prompt_tokens
        if n == 0:
            return "empty prompt: a request needs at least one prompt token"
        if n > self.config.max_model_len:
            return f"prompt has {n} tokens, longer than max_model_len={self.config.max_model_len}"
        pages = -(-(n if cache_tokens is None else cache_tokens) // self.config.page_size)
        room = self.allocator.narrow_pages  # a prompt is held whole in every layer until compressed
        if pages > room:
            if not self.allocator.tiered:
                return (f"prompt needs {pages} KV pages but the pool holds {room}; "
                        f"raise kv_cache_memory / gpu_memory_utilization or num_kv_pages")
            return (f"prompt needs {pages} KV pages but the pool holds {room} narrow pages (of "
                    f"{self.allocator.num_pages}), where a prompt is held whole until compressed; size the tiers "
                    "for longer prompts (kv_pool_tier_tokens), turn them off (kv_pool_tiers=off), or raise "
                    "kv_cache_memory / gpu_memory_utilization")
        return None

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.prefill_alone = (self.config.prefill_policy == "long_bs1full_short_batch"
                             and seq.num_prompt_tokens > self.config.long_prefill_threshold)
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -----------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self.waiting and self.waiting[0].prefill_alone and self._schedule_alone(batch):
            return batch
        budget = self.config.max_num_batched_tokens
        decoding, others = [], []
        for s in self.running:
            (decoding if s.is_decoding else others).append(s)
        for seq in decoding:
            if len(batch.seqs) >= self.config.max_num_seqs or budget < 1:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted while making room
                continue
            if self._make_room(seq, 1, batch):
                batch.seqs.append(seq)
                batch.num_new_tokens.append(1)
                budget -= 1
        for seq in others:
            if len(batch.seqs) >= self.config.max_num_seqs or budget < 1:
                break
            if seq.status != SequenceStatus.RUNNING or seq in batch.seqs or seq.num_uncomputed == 0:
                continue
            n = min(seq.num_uncomputed, self.config.prefill_chunk_size, budget)
            if self._make_room(seq, n, batch):
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.prefill_alone:
                break
            n = min(seq.num_uncomputed, self.config.prefill_chunk_size, budget)
            need = self._pages_needed(seq, n)
            if not self.allocator.can_allocate(*need):
                break
            self.waiting.popleft()
            seq.page_table += self.allocator.allocate(*need)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _schedule_alone(self, batch: ScheduledBatch) -> bool:
        """long_bs1full_short_batch: a long prompt runs alone in one unchunked pass."""
        seq = self.waiting[0]
        need = self._pages_needed(seq, seq.num_uncomputed)
        while not self.allocator.can_allocate(*need) and self.running:
            self._preempt(self.running[-1], batch)
        if not self.allocator.can_allocate(*need):
            return False
        self.waiting.popleft()
        seq.page_table += self.allocator.allocate(*need)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(seq.num_uncomputed)
        return True

    def _pages_needed(self, seq: Sequence, n: int) -> tuple[int, int]:
        """(narrow, wide) pages to add for ``n`` more tokens: logical pages below the
        request's narrow bound must hold every layer."""
        ps = self.config.page_size
        have, want = len(seq.page_table), -(-(seq.num_cached_tokens + n) // ps)
        if want <= have:
            return 0, 0
        bound = self.narrow_bound(seq) if self.allocator.tiered else None
        narrow_end = want if bound is None else min(want, max(have, -(-bound // ps)))
        return narrow_end - have, want - narrow_end

    def _make_room(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        need = self._pages_needed(seq, n)
        if need == (0, 0):  # most decode steps: the token fits the last page
            return True
        while not self.allocator.can_allocate(*need):
            victims = [s for s in reversed(self.running) if s is not seq and s not in batch.seqs]
            if not victims:
                if len(self.running) == 1:  # alone and still no room: it can never fit
                    self.finish(seq, "error", error=(
                        f"KV pool exhausted: the request needs more than the {self.allocator.num_pages} "
                        f"pages of the pool"))
                    batch.failed.append(seq)
                    return False
                self._preempt(seq, batch)
                return False
            self._preempt(victims[0], batch)
        seq.page_table += self.allocator.allocate(*need)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.page_table)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    # ---- after the step -------------------------------------------------------------
    def advance(self, batch: ScheduledBatch) -> None:
        """The step's tokens are now in every layer's cache."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            seq.layer_lens = [x + n for x in seq.layer_lens]

    def trim_pages(self, seq: Sequence, room: int = 0) -> int:
        """Return the pages past the longest layer to the pool (after an eviction), keeping
        room for ``room`` tokens (a row that regrows before its next eviction keeps its
        pages instead of trading them every step)."""
        keep = -(-max(seq.num_cached_tokens, room) // self.config.page_size)
        extra = seq.page_table[keep:]
        if extra:
            del seq.page_table[keep:]
            self.allocator.free(extra)
        return len(extra)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.page_table:
            self.allocator.free(seq.page_table)
            seq.page_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
