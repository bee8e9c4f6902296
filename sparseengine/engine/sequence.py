"""One request's state: plain Python, no torch, so the scheduler can be tested alone."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

from sparseengine.engine.page_table import PageTable
from sparseengine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)  # identity: two requests with the same prompt are different requests
class Sequence:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    num_layers: int
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V have been computed (logical positions)
    page_table: PageTable = field(default_factory=PageTable)  # any list assigned becomes one
    layer_lens: list[int] = field(default_factory=list)  # tokens held in the cache, per layer
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_alone: bool = False  # long_bs1full_short_batch: one unchunked pass, nothing beside it
    prompt_logits: list | None = None  # set to [] to collect the logits of every prompt position
    prompt_logits_from: int = 0  # ... from this one on
    kv_tokens_at_end: float | None = None

    def __setattr__(self, name, value) -> None:
        if name == "page_table" and not isinstance(value, PageTable):
            value = PageTable(value)
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        if not self.layer_lens:
            self.layer_lens = [0] * self.num_layers

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """Tokens start..start+n-1 of prompt + outputs, without concatenating the two."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:start - p + n]
        head = self.prompt_token_ids[start:start + n]
        return head + self.output_token_ids[: n - len(head)] if len(head) < n else head

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Slots used in the page table: the longest layer."""
        return max(self.layer_lens) if self.layer_lens else 0

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Prompt (and any recomputed outputs) done: each step feeds one token."""
        return bool(self.output_token_ids) and self.num_uncomputed == 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the cache; prompt + outputs are prefilled again."""
        self.num_computed_tokens = 0
        self.layer_lens = [0] * self.num_layers
        self.page_table = []
        self.num_preemptions += 1
        if self.prompt_logits is not None:
            self.prompt_logits = []
        self.status = SequenceStatus.WAITING
