"""A request's page table: physical page ids, logical page i at index i.

A plain list that remembers the first index changed since its reader last asked
(`take_changed_from`), so the decode graph's host mirror rewrites only the pages that
changed instead of comparing 8192 pages a request (a 128K prompt in pages of 16) every
step. Every in-place change marks it; assigning a new table starts one marked from 0.
"""

from __future__ import annotations


def _first(index, length: int) -> int:
    """The lowest position an index or slice touches (0 when unsure)."""
    if isinstance(index, slice):
        start, _, step = index.indices(length)
        return start if step == 1 else 0
    return index % length if length else 0


class PageTable(list):
    __slots__ = ("_changed_from",)

    def __init__(self, pages=()) -> None:
        super().__init__(pages)
        self._changed_from: int | None = 0

    def _mark(self, at: int) -> None:
        self._changed_from = at if self._changed_from is None else min(self._changed_from, at)

    def take_changed_from(self) -> int | None:
        """The first index changed since the last call (0: all of it; None: nothing)."""
        at, self._changed_from = self._changed_from, None
        return at

    def __iadd__(self, pages):
        self.extend(pages)
        return self

    def append(self, page) -> None:
        self._mark(len(self))
        super().append(page)

    def extend(self, pages) -> None:
        pages = list(pages)
        if pages:  # appending nothing changes nothing (a decode step that needs no new page)
            self._mark(len(self))
        super().extend(pages)

    def __setitem__(self, index, value) -> None:
        self._mark(_first(index, len(self)))
        super().__setitem__(index, value)

    def __delitem__(self, index) -> None:
        self._mark(_first(index, len(self)))
        super().__delitem__(index)

    def pop(self, index=-1):
        self._mark(_first(index, len(self)))
        return super().pop(index)

    def insert(self, index, page) -> None:
        self._mark(0)
        super().insert(index, page)

    def remove(self, page) -> None:
        self._mark(0)
        super().remove(page)

    def clear(self) -> None:
        self._mark(0)
        super().clear()

    def sort(self, *args, **kwargs) -> None:
        self._mark(0)
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self._mark(0)
        super().reverse()

    def __imul__(self, n):
        self._mark(0)
        return super().__imul__(n)
