"""Does a batch fit in the KV pool? And the largest batch that does (doubling, then bisection).

Fitting is computed from the engine, not guessed: a batch fits when its KV, in whole
pages, fits in ``llm.allocator.num_pages`` pages and the batch is within ``max_num_seqs``.
A method that frees memory still holds a whole prompt until it compresses it, so the
batch needs ``(B - 1) x steady + peak`` pages: one request at its prefill peak while the
others sit at their steady size (in a ragged batch, ``length_mix``: every request's steady
size plus the largest peak-over-steady among them).

The steady size comes from ``LLM.kv_tokens_needed`` (each method runtime's
``max_cache_tokens``), so this file restates nothing about any method.

A pool in two tiers (``sparseengine/engine/pool_plan.py``, DeltaKV): a compressed request
holds ``LLM.narrow_tokens`` of its pages in the narrow tier and the rest in the wide tier
(in narrow pages where the wide tier is full), and a prompt is held whole in narrow pages
until it is compressed; so the narrow tier must hold every request's narrow part, the wide
parts that overflow the wide tier, and the last request's whole prompt.
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
    narrow_pages: int | None = None  # a two-tier pool's narrow tier; None: one tier
    # of each pattern entry's steady pages (or of every request's), those in the wide tier
    wide_per_request: tuple[int, ...] = ()
    one_tier_pages: int | None = None  # a two-tier pool's budget in one tier (``dense``)

    @property
    def narrow_tier(self) -> int:
        return self.num_pages if self.narrow_pages is None else self.narrow_pages

    def _requests(self, batch: int) -> list[tuple[int, int, int]]:
        pattern = self.pattern or ((self.pages_per_request, self.peak_pages_per_request or self.pages_per_request),)
        wide = self.wide_per_request or (0,)
        return [(*pattern[i % len(pattern)], wide[i % len(wide)]) for i in range(batch)]

    def pages(self, batch: int) -> int:
        """Narrow pages (every page, one tier): every request at its steady size but the one
        whose prefill peak adds most, which is held whole; wide parts past the wide tier
        in narrow pages."""
        requests = self._requests(batch)
        if not requests:
            return 0
        last = max(range(batch), key=lambda i: requests[i][1] - requests[i][0])
        others = requests[:last] + requests[last + 1:]
        overflow = max(0, sum(w for _, _, w in others) - (self.num_pages - self.narrow_tier))
        return sum(s - w for s, _, w in others) + overflow + requests[last][1]

    def fits(self, batch: int) -> bool:
        return batch <= self.max_num_seqs and self.pages(batch) <= self.narrow_tier

    def dense(self) -> "Capacity":
        """The same memory in one tier for a method that holds every prompt token (vanilla)."""
        peak = self.peak_pages_per_request or self.pages_per_request
        return Capacity(self.one_tier_pages or self.num_pages, self.page_size, peak, self.max_num_seqs, peak,
                        tuple((p, p) for _, p in self.pattern))

    def reason(self, batch: int) -> str:
        if batch > self.max_num_seqs:
            return f"batch {batch} > max_num_seqs={self.max_num_seqs}"
        need, room = self.pages(batch), self.narrow_tier
        if self.narrow_pages is None:
            said = f"needs {need} KV pages, the pool holds {room}"
        else:
            said = (f"needs {need} narrow KV pages, the narrow tier holds {room} "
                    f"(the wide tier's {self.num_pages - room} pages hold the rest)")
        return said + ("" if need > room else " (fits)")


def capacity_of(llm, prompt_len: int, output_len: int, lengths: tuple[int, ...] | None = None) -> Capacity:
    """``lengths``: a ragged batch's repeating pattern of prompt lengths (``LengthMix``);
    None: every prompt ``prompt_len`` tokens."""
    cfg = llm.config

    def pages(n: int) -> tuple[int, int]:
        steady = llm.kv_tokens_needed(n, output_len)  # the method runtime's own account
        return -(-steady // cfg.page_size), -(-(n + output_len) // cfg.page_size)

    def wide(n: int) -> int:  # of the steady pages, those in the wide tier (0 in one tier)
        held = llm.narrow_tokens(n)
        return 0 if held is None else max(0, pages(n)[0] - -(-held // cfg.page_size))

    sizes = tuple(lengths) if lengths and len(set(lengths)) > 1 else ((lengths or (prompt_len,))[0],)
    steady, peak = pages(sizes[0])
    tiered = llm.allocator.tiered
    return Capacity(num_pages=llm.allocator.num_pages, page_size=cfg.page_size, pages_per_request=steady,
                    max_num_seqs=cfg.max_num_seqs, peak_pages_per_request=peak,
                    pattern=tuple(pages(n) for n in sizes) if len(sizes) > 1 else (),
                    narrow_pages=llm.allocator.narrow_pages if tiered else None,
                    wide_per_request=tuple(wide(n) for n in sizes) if tiered else (),
                    one_tier_pages=llm.pool_plan.one_tier_pages)


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
