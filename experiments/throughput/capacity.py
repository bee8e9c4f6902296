"""Does a batch fit in the KV pool? And the largest batch that does (doubling, then bisection).

Fitting is computed from the engine, not guessed: a batch fits when its KV, in whole
pages, fits in ``llm.allocator.num_pages`` pages and the batch is within ``max_num_seqs``.
A method that frees memory still holds a whole prompt until it compresses it, so the
batch needs ``(B - 1) x steady + peak`` pages: one request at its prefill peak while the
others sit at their steady size (in a ragged batch, ``length_mix``: every request's steady
size plus the largest peak-over-steady among them).

The steady size comes from ``LLM.kv_tokens_needed`` (each method runtime's
``max_cache_tokens``), so this file restates nothing about any method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Capacity:
    num_pages: int
    page_size: int
    pages_per_request: int  # steady state, during decode (the pattern's first request's)
    max_num_seqs: int
    peak_pages_per_request: int | None = None  # while its whole prompt is held; None: the steady size
    # A ragged batch (``length_mix``): (steady, peak) pages of each request of a pattern that
    # repeats over the batch; empty: every request as above.
    pattern: tuple[tuple[int, int], ...] = ()

    def _requests(self, batch: int) -> list[tuple[int, int]]:
        pattern = self.pattern or ((self.pages_per_request, self.peak_pages_per_request or self.pages_per_request),)
        return [pattern[i % len(pattern)] for i in range(batch)]

    def pages(self, batch: int) -> int:
        """Every request at its steady size, and the one whose prefill peak adds most at it."""
        requests = self._requests(batch)
        return sum(s for s, _ in requests) + max(p - s for s, p in requests) if requests else 0

    def fits(self, batch: int) -> bool:
        return batch <= self.max_num_seqs and self.pages(batch) <= self.num_pages

    def dense(self) -> "Capacity":
        """The same pool for a method that holds every prompt token (vanilla)."""
        peak = self.peak_pages_per_request or self.pages_per_request
        return Capacity(self.num_pages, self.page_size, peak, self.max_num_seqs, peak,
                        tuple((p, p) for _, p in self.pattern))

    def reason(self, batch: int) -> str:
        if batch > self.max_num_seqs:
            return f"batch {batch} > max_num_seqs={self.max_num_seqs}"
        need = self.pages(batch)
        return f"needs {need} KV pages, the pool holds {self.num_pages}" + ("" if need > self.num_pages else " (fits)")


def capacity_of(llm, prompt_len: int, output_len: int, lengths: tuple[int, ...] | None = None) -> Capacity:
    """``lengths``: a ragged batch's repeating pattern of prompt lengths (``LengthMix``);
    None: every prompt ``prompt_len`` tokens."""
    cfg = llm.config

    def pages(n: int) -> tuple[int, int]:
        steady = llm.kv_tokens_needed(n, output_len)  # the method runtime's own account
        return -(-steady // cfg.page_size), -(-(n + output_len) // cfg.page_size)

    steady, peak = pages(lengths[0] if lengths else prompt_len)
    pattern = tuple(pages(n) for n in lengths) if lengths and len(set(lengths)) > 1 else ()
    return Capacity(num_pages=llm.allocator.num_pages, page_size=cfg.page_size, pages_per_request=steady,
                    max_num_seqs=cfg.max_num_seqs, peak_pages_per_request=peak, pattern=pattern)


@dataclass(frozen=True)
class SearchResult:
    largest: int  # 0 when not even one request fits
    first_unfit: int  # the next size up, which must not fit
    probes: tuple[tuple[int, bool], ...]


def max_batch(fits: Callable[[int], bool], limit: int = 1 << 20) -> SearchResult:
    """Double from 1 until a batch does not fit, then bisect between the last two sizes."""
    probes: list[tuple[int, bool]] = []

    def probe(b: int) -> bool:
        ok = fits(b)
        probes.append((b, ok))
        return ok

    if not probe(1):
        return SearchResult(0, 1, tuple(probes))
    lo, hi = 1, 2
    while hi <= limit and probe(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return SearchResult(lo, hi, tuple(probes))
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    return SearchResult(lo, hi, tuple(probes))
