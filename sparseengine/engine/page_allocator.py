"""The KV page pool's bookkeeping: which pages are free. Plain Python.

Two tiers when the pool has narrow layers (``KVCache``): pages ``[0, narrow_pages)`` hold
every layer (*narrow* pages: any use), pages ``[narrow_pages, num_pages)`` only the wide
layers (*wide* pages: logical pages that no narrow layer of their request will hold). A
request asks for ``n_narrow`` pages that must hold every layer and ``n_wide`` that may be
wide; a wide request takes narrow pages when the wide tier runs out (they hold every
layer, so they serve either). With no narrow layers every page is narrow.
"""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, narrow_pages: int | None = None) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        narrow = num_pages if narrow_pages is None else narrow_pages
        if not 0 < narrow <= num_pages:
            raise ValueError(f"narrow_pages must be in [1, num_pages={num_pages}], got {narrow_pages}")
        self.num_pages = num_pages
        self.narrow_pages = narrow
        self._free: deque[int] = deque(range(narrow))
        self._free_wide: deque[int] = deque(range(narrow, num_pages))
        self._used: set[int] = set()
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._free_wide)

    @property
    def num_free_narrow(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def tiered(self) -> bool:
        return self.narrow_pages < self.num_pages

    def is_narrow(self, page: int) -> bool:
        return page < self.narrow_pages

    def can_allocate(self, n: int, n_wide: int = 0) -> bool:
        """Room for ``n`` narrow pages and ``n_wide`` more of either tier."""
        return n <= len(self._free) and n + n_wide <= self.num_free

    def allocate(self, n: int, n_wide: int = 0) -> list[int]:
        """``n`` narrow pages, then ``n_wide`` wide ones (narrow where the wide tier is out)."""
        if not self.can_allocate(n, n_wide):
            raise OutOfPages(f"asked for {n} narrow + {n_wide} wide pages, {len(self._free)} narrow and "
                             f"{len(self._free_wide)} wide free")
        pages = [self._free.popleft() for _ in range(n)]
        wide = min(n_wide, len(self._free_wide))
        pages += [self._free_wide.popleft() for _ in range(wide)]
        pages += [self._free.popleft() for _ in range(n_wide - wide)]
        self._used.update(pages)
        self.peak_used = max(self.peak_used, len(self._used))
        return pages

    def take_wide(self, n: int) -> list[int]:
        """Up to ``n`` wide-tier pages (fewer if the tier runs out; none narrow)."""
        pages = [self._free_wide.popleft() for _ in range(min(n, len(self._free_wide)))]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not in use")
            self._used.remove(p)
            (self._free if p < self.narrow_pages else self._free_wide).append(p)
