"""Executables compiled off the engine's thread, and the wider ones a step runs on meanwhile.

Penalties, logit bias, min_tokens, logprobs and grammars run in executables of their own
("processed" and "constrained" variants), which a lazily compiling engine builds on first use.
Built in the loop, each would stop the whole batch for as long as an 8B step takes to compile;
built here, the batch goes on without the requests that need it, which join once it is ready.
A GPU start-up builds only the widest executable of every kind before serving and queues the
rest here: until its own is ready, a step runs padded on the widest (own_or_cover).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class ExecutablePending(Exception):
    """The executable a dispatch asked for is still compiling in the background; nothing was
    dispatched or changed."""


class BackgroundCompiles:
    """One compile thread and the executables it is building, each bound for a worker's cache."""

    def __init__(self, compile_fn: Callable):
        """compile_fn(lowered) -> compiled (the runner's, without noting a stall)."""
        self._compile = compile_fn
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict = {}  # (id(cache), key) -> (cache, key, future, start time)
        self._queueing = False  # inside queue(): every executable asked for is queued here

    def queue(self, builds) -> int:
        """Queue executables here: each of ``builds`` is a worker's compile thunk (which asks the
        engine for its executable, and raises ExecutablePending once it is queued); those built
        or queued already are skipped.  Returns how many were queued (logged by the caller)."""
        queued = 0
        self._queueing = True
        try:
            for build in builds:
                try:
                    build()
                except ExecutablePending:
                    queued += 1
        finally:
            self._queueing = False
        return queued

    def takes(self, cache: dict, key) -> bool:
        """Whether key's executable for this cache builds here: queued already, or being queued."""
        return self._queueing or (id(cache), key) in self._pending

    def get(self, cache: dict, key, lower: Callable):
        """cache[key] once its background compile has finished; else starts that compile (once)
        and raises ExecutablePending.  A compile error is raised here, on the caller's thread."""
        self._collect()
        if key in cache:
            return cache[key]
        if (id(cache), key) not in self._pending:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dspark-compile")
            self._pending[id(cache), key] = (cache, key, self._pool.submit(lambda: self._compile(lower())),
                                             time.perf_counter())
            if not self._queueing:
                log.info("compiling %s in the background; the requests that need it wait", key)
        raise ExecutablePending(key)

    def _collect(self) -> None:
        """Move finished compiles into their caches (on the caller's thread, so a cache never
        changes under a reader)."""
        for ident, (cache, key, future, t0) in list(self._pending.items()):
            if future.done():
                del self._pending[ident]
                cache[key] = future.result()
                log.info("%s ready, %.1f s after its background compile started", key, time.perf_counter() - t0)

    def _running(self) -> list:
        """The futures of the compiles still running or queued."""
        return [future for _, _, future, _ in self._pending.values() if not future.done()]

    @property
    def busy(self) -> bool:
        """Whether a compile is still running or queued."""
        return bool(self._running())

    def close(self) -> None:
        """Drop the compiles still queued (one running finishes), so shutting down waits for at
        most one."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._pending.clear()

    def finish(self) -> None:
        """Block until every queued compile has finished, and take them in."""
        concurrent.futures.wait(self._running())
        self._collect()

    def wait(self, timeout: float) -> None:
        """Block until one pending compile finishes or timeout seconds pass (for a loop whose
        every request waits on one)."""
        running = self._running()
        if running:
            concurrent.futures.wait(running, timeout, concurrent.futures.FIRST_COMPLETED)


def own_or_cover(cache: dict, key: tuple, get: Callable, *, dims: tuple[int, ...], widest: tuple | None):
    """(key, executable) of a step: key's own, or while that compiles in the background, the
    narrowest compiled key as wide or wider at the positions ``dims`` (tokens, rows, pages: the
    step runs padded) and equal to key elsewhere.
    get(key) returns key's executable or raises ExecutablePending.  ``widest`` (a shape that
    holds any batch of key's kind) is asked for first, so after one compile nothing waits."""
    if widest is not None and widest != key:
        try:
            get(widest)
        except ExecutablePending:
            pass
    try:
        return key, get(key)
    except ExecutablePending:
        wide = {d % len(key) for d in dims}
        covers = [k for k in cache if isinstance(k, tuple) and len(k) == len(key)
                  and all(k[i] >= key[i] if i in wide else k[i] == key[i] for i in range(len(key)))]
        if not covers:
            raise
        cover = min(covers, key=lambda k: [k[i] for i in sorted(wide)])
        return cover, cache[cover]
