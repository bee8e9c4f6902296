"""The last step's sampled tokens while the device may still be computing them
(asynchronous scheduling).

With ``async_scheduling`` the engine launches step k+1 before it reads step k's tokens:
a request sampled at step k holds a placeholder as its last output token, so the
scheduler and the step's inputs (positions, slots, lengths, page tables) see the right
lengths, and a decode row whose input is that token reads it on the device (``Feed``).
The host then reads step k's tokens (copied to pinned memory right behind their
sampling, waited on by an event: the device is done with step k and busy with step k+1)
and settles them, so the host's work for a step overlaps the device's work for the step
before. A row that needs an in-flight token any other way (a
preempted request prefilled again in the same step) makes the engine read the tokens
first (``NEEDS_TOKENS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparseengine.engine.scheduler import ScheduledBatch
from sparseengine.engine.sequence import Sequence

PLACEHOLDER = -1  # an output token the device has sampled and the host has not read yet
NEEDS_TOKENS = "needs_tokens"  # ``Inflight.feed``: read the tokens on the host first


@dataclass(frozen=True)
class Feed:
    """Decode rows of a step whose input token is in flight: the step's token
    ``rows[i]`` (an offset among all the step's tokens; a graph step's row) is
    ``tokens[src[i]]``."""
    rows: list[int]
    src: list[int]
    tokens: torch.Tensor

    def apply(self, ids: torch.Tensor) -> None:
        """Write the fed rows of a step's token ids ``ids`` (on the device), in stream
        order after whatever wrote ``ids`` before: no host sync."""
        n = len(self.rows)
        if self.rows == self.src == list(range(n)) and self.tokens.numel() == n:  # the same batch again
            ids[:n].copy_(self.tokens)
            return
        rows, src = (_upload(v, ids.device) for v in (self.rows, self.src))
        ids.index_copy_(0, rows, self.tokens.index_select(0, src))


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """A small index list on the device, from pinned memory (a pageable copy would first
    wait for the queued work)."""
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


@dataclass
class Inflight:
    """Step k's sampled requests (``seqs``, each with a placeholder as its last output
    token until ``read``) and their tokens on the device (``tokens[rows[i]]``)."""
    seqs: list[Sequence]
    rows: list[int]
    tokens: torch.Tensor
    _row_of: dict[int, int] = field(default_factory=dict)
    _read: list[int] | None = None
    _host: torch.Tensor | None = None
    _copied: "torch.cuda.Event | None" = None

    def __post_init__(self) -> None:
        self._row_of = {s.seq_id: r for s, r in zip(self.seqs, self.rows)}
        if self.tokens.is_cuda:  # to pinned memory right behind the sampling, with an event: reading
            # them later waits for this step only (a plain .tolist() would queue behind the next step)
            self._host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self._host.copy_(self.tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def feed(self, batch: ScheduledBatch) -> Feed | None | str:
        """How ``batch`` reads the in-flight tokens: a ``Feed`` for its decode rows whose
        input is one, None when no row reads one, ``NEEDS_TOKENS`` when a row reads one
        inside a longer chunk."""
        if self._read is not None:
            return None  # already on the host, in the requests' token lists
        rows, src = [], []
        offset = 0  # of the row's first token among the step's tokens
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            offset += n
            r = self._row_of.get(seq.seq_id)
            if r is None:
                continue
            last = seq.num_tokens - 1  # the placeholder
            start = seq.num_computed_tokens
            if start + n <= last:
                continue
            if n != 1 or start != last:
                return NEEDS_TOKENS
            rows.append(offset - 1)
            src.append(r)
        return Feed(rows, src, self.tokens) if rows else None

    def read(self) -> list[int]:
        """The tokens on the host (waits for the step that sampled them), written over the
        placeholders; one entry per ``seqs``."""
        if self._read is None:
            if self._copied is not None:
                self._copied.synchronize()
            values = (self.tokens if self._host is None else self._host).tolist()
            self._read = [values[r] for r in self.rows]
            for seq, tok in zip(self.seqs, self._read):  # nothing is appended while a step is in flight
                seq.output_token_ids[-1] = tok
        return self._read
