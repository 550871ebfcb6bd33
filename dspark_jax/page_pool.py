"""Host-side page allocator for the paged KV cache.

Pages are handed out whole; a request owns the pages that hold its tokens, listed in order
(its page table).  Every operation either succeeds completely or raises KVPoolFullError having
changed nothing, so a request that does not fit can wait without disturbing anyone.  Page 0 is
the sentinel page (padding rows write there) and is never handed out.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from dspark_jax.errors import KVPoolFullError

SENTINEL_PAGE = 0


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("a page pool needs the sentinel page plus at least one usable page")
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, SENTINEL_PAGE, -1))  # pop() gives low ids first
        self._owned: dict[Hashable, list[int]] = {}

    # -- accounting ---------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def capacity_tokens(self) -> int:
        return self.num_usable_pages * self.page_size

    @property
    def used_tokens_capacity(self) -> int:
        return (self.num_usable_pages - self.num_free_pages) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages(self, owner: Hashable) -> list[int]:
        return self._owned.get(owner, [])

    def can_reserve(self, owner: Hashable, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(self.pages(owner)) <= self.num_free_pages

    # -- mutation -----------------------------------------------------------------------
    def reserve(self, owner: Hashable, num_tokens: int) -> list[int]:
        """Make `owner` hold enough pages for `num_tokens` tokens (allocate or extend)."""
        have = self._owned.get(owner, [])
        need = self.pages_for(num_tokens) - len(have)
        if need > len(self._free):
            raise KVPoolFullError(
                f"KV pool full: {owner!r} needs {need} more pages of {self.page_size} tokens, "
                f"{len(self._free)} of {self.num_usable_pages} free"
            )
        if need > 0:
            new = [self._free.pop() for _ in range(need)]
            self._owned[owner] = have + new
        else:
            self._owned.setdefault(owner, have)
        return self._owned[owner]

    def free(self, owner: Hashable) -> int:
        """Return all of `owner`'s pages to the pool; freeing an unknown owner is a no-op."""
        pages = self._owned.pop(owner, [])
        self._free.extend(reversed(pages))
        return len(pages)

    # -- views --------------------------------------------------------------------------
    def page_table_row(self, owner: Hashable, width: int) -> np.ndarray:
        row = np.full(width, SENTINEL_PAGE, np.int32)
        pages = self.pages(owner)
        row[: len(pages)] = pages
        return row

    def check_invariants(self) -> None:
        """Every usable page is free xor owned by exactly one owner; the sentinel is neither."""
        owned = [p for ps in self._owned.values() for p in ps]
        all_pages = owned + self._free
        assert SENTINEL_PAGE not in all_pages, "sentinel page handed out"
        assert len(all_pages) == len(set(all_pages)), "a page is owned twice or both owned and free"
        assert sorted(all_pages) == list(range(1, self.num_pages)), "a page was lost"
