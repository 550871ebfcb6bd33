"""Host page allocator: invariants under random reserve/free, atomic failure."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.errors import KVPoolFullError
from dspark_jax.page_pool import SENTINEL_PAGE, PagePool


@pytest.mark.parametrize("seed", range(5))
def test_random_reserve_free_keeps_invariants(seed):
    rng = np.random.default_rng(seed)
    pool = PagePool(num_pages=40, page_size=int(rng.integers(1, 9)))
    sizes: dict[int, int] = {}
    for _ in range(600):
        op = rng.random()
        owner = int(rng.integers(0, 12))
        if op < 0.6:
            want = sizes.get(owner, 0) + int(rng.integers(0, 3 * pool.page_size))
            free_before = pool.num_free_pages
            pages_before = list(pool.pages(owner))
            need = pool.pages_for(want) - len(pages_before)
            if need > free_before:
                with pytest.raises(KVPoolFullError):
                    pool.reserve(owner, want)
                assert pool.num_free_pages == free_before and pool.pages(owner) == pages_before
            else:
                pages = pool.reserve(owner, want)
                assert pages[: len(pages_before)] == pages_before  # extension never moves pages
                assert len(pages) == max(len(pages_before), pool.pages_for(want))
                sizes[owner] = max(sizes.get(owner, 0), want)
        else:
            n = len(pool.pages(owner))
            assert pool.free(owner) == n
            sizes.pop(owner, None)
        pool.check_invariants()
        owned = sum(len(pool.pages(o)) for o in range(12))
        assert owned + pool.num_free_pages == pool.num_usable_pages
        assert pool.used_tokens_capacity == owned * pool.page_size
        assert all(SENTINEL_PAGE not in pool.pages(o) for o in range(12))


def test_page_table_row_pads_with_sentinel():
    pool = PagePool(8, 4)
    pool.reserve("a", 9)
    row = pool.page_table_row("a", 5)
    assert list(row[:3]) == pool.pages("a") and list(row[3:]) == [SENTINEL_PAGE] * 2


def test_pool_needs_a_usable_page():
    with pytest.raises(ValueError):
        PagePool(1, 4)
