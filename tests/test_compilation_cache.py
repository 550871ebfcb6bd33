"""The persistent compilation cache survives a write that never finished."""

from __future__ import annotations

import pytest

from dspark_jax.engine.model_runner import repair_compilation_cache


def test_an_interrupted_write_is_removed_and_the_cache_writes_again(tmp_path):
    from jax._src.lru_cache import LRUCache

    cache = LRUCache(str(tmp_path), max_size=2**30)
    cache.put("done", b"complete entry")
    # a process killed between writing an executable and its access time
    (tmp_path / "killed-cache").write_bytes(b"trunc")
    # JAX's size check reads every entry's access time, so no write succeeds (a bound small enough
    # that the suite's throttled check, tests/conftest.py, runs the real one)
    with pytest.raises(FileNotFoundError):
        LRUCache(str(tmp_path), max_size=32).put("next", b"x")
    assert repair_compilation_cache(tmp_path) == 1
    assert not (tmp_path / "killed-cache").exists()
    assert cache.get("done") == b"complete entry"  # complete entries stay
    fresh = LRUCache(str(tmp_path), max_size=32)
    fresh.put("next", b"x")
    assert fresh.get("next") == b"x"
    assert repair_compilation_cache(tmp_path) == 0
