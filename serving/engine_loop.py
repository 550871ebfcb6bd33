"""The engine thread: the one thread that owns the (not thread-safe) Engine.

The HTTP event loop talks to it only through a thread-safe command queue (submit, abort,
abort-all, stop).  Requests arrive validated and tokenized: the engine thread never tokenizes.
Each submitted request gets a `RequestStream`, whose events the engine thread puts on an asyncio
queue on the HTTP loop with `loop.call_soon_threadsafe` (the choices of one HTTP request share a
queue).  Events of one request, in order:

    ("accepted", {"prompt_tokens": n})   the engine queued the request
    ("delta", new_ids, text_so_far, lp)  tokens committed by one engine step; lp: their
                                         (logprobs, top logprobs) when the request asked, else None
    ("done", GenerationResult)           finished (stop, length or abort); nothing follows
    ("error", exception)                 failed; nothing follows.  InvalidRequestError: the engine
                                         refused it (400); RequestFailedError: handling this request
                                         raised (500, other requests carry on); EngineDeadError:
                                         engine.step() raised (500, every request fails);
                                         ServerStoppingError: the loop had stopped (503)

Every stream gets exactly one final event, whatever breaks.  Between commands the thread runs
`engine.step()` while there is work (continuous batching) and publishes a `snapshot` dict
(running/queued counts, KV usage, throughput) that the HTTP side reads without locking.

Faults: an exception while handling one request's command or events fails that request only
(the engine is asked to abort it).  An exception from `engine.step()` (or the engine's own
bookkeeping between steps) means the engine is dead: every in-flight and queued request fails,
`error` is set, the thread ends and `on_fatal(error)` is called once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid

from dspark_jax.errors import InvalidRequestError
from dspark_jax.sampling import SamplingParams
from dspark_jax.token_rate import TokenRate

log = logging.getLogger(__name__)


class RequestFailedError(RuntimeError):
    """Handling one request raised; the engine and other requests are unaffected."""


class EngineDeadError(RuntimeError):
    """engine.step() raised: the engine can serve nothing more until the process restarts."""


class ServerStoppingError(RuntimeError):
    """The engine loop had stopped before the request could be queued."""


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class RequestStream:
    """The HTTP side of one engine request.  The engine thread pushes ``(stream, event)`` pairs
    onto `queue`, an asyncio queue on the HTTP loop; the engine requests behind one HTTP request
    (its choices) share one queue, and `index` tells them apart."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue | None = None,
                 index: int = 0):
        self.id = request_id
        self.index = index
        self._loop = loop
        self.queue: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        self.finished = False  # set by the reader once it has taken the final event

    def push(self, event: tuple) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, (self, event))
        except RuntimeError:  # the HTTP loop is closed (shutdown): nobody listens any more
            pass


class EngineLoop:
    def __init__(self, engine, metrics=None, *, on_fatal=None, throughput_window_s: float = 2.0):
        self.engine = engine
        self.metrics = metrics
        self.on_fatal = on_fatal  # called once, on the engine thread, after a fatal engine error
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._stopped = threading.Event()
        self._closed = False  # no more commands are read: guarded by _lock with the queue
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._rate = TokenRate(throughput_window_s)
        self._spec_seen = 0
        self._observe_failures = 0
        self.total_steps = 0
        self.snapshot: dict = {}
        self._publish()

    # -- HTTP side (any thread) ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def submit(self, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
               prefix: str = "req", queue: asyncio.Queue | None = None, index: int = 0) -> RequestStream:
        stream = RequestStream(f"{prefix}-{uuid.uuid4().hex[:24]}", loop, queue, index)
        with self._lock:
            if not self._closed:
                self._commands.put(("add", stream, prompt_ids, params))
                return stream
        stream.push(("error", self._closed_error()))
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        self._commands.put(("abort_all",))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything and end the thread (and the engine's queued background compiles)."""
        self._commands.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout)
        background = getattr(self.engine, "background", None)
        if background is not None:
            background.close()

    def _closed_error(self) -> Exception:
        if self.error is not None:
            return EngineDeadError(f"the engine failed and stopped ({describe(self.error)}); the server must be restarted")
        return ServerStoppingError("the engine loop has stopped: the server is shutting down")

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self._stopped.is_set():
                    break
                if self.engine.has_unfinished():
                    self._step()
                self._publish()
        except BaseException as e:  # noqa: BLE001 - a dead engine must not hang clients
            log.critical("the engine failed; failing every request and stopping (%s)", describe(e), exc_info=True)
            self.error = e
        self._close()
        if self.error is not None and self.on_fatal is not None:
            try:
                self.on_fatal(self.error)
            except Exception:  # noqa: BLE001
                log.exception("on_fatal hook failed")

    def _close(self) -> None:
        """Answer every stream still waiting: queued commands and in-flight requests."""
        with self._lock:
            self._closed = True
        pending = []
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in pending:
            if cmd[0] == "add":
                cmd[1].push(("error", self._closed_error()))
        if self.error is not None:  # the engine is broken: do not call it again
            err = EngineDeadError(f"the engine failed while serving this request: {describe(self.error)}")
            for stream in self._streams.values():
                stream.push(("error", err))
            self._streams.clear()
        else:
            for rid in list(self._streams):
                self._guarded(rid, self._abort, rid)
        try:
            self._publish()
        except Exception:  # noqa: BLE001
            pass

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            if self._stopped.is_set():
                return
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add(cmd[1], cmd[2], cmd[3])
        elif kind == "abort":
            self._guarded(cmd[1], self._abort, cmd[1])
        elif kind == "abort_all":
            for rid in list(self._streams):
                self._guarded(rid, self._abort, rid)
        elif kind == "stop":
            self._stopped.set()

    def _add(self, stream: RequestStream, prompt_ids, params) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=stream.id)
        except InvalidRequestError as e:
            stream.push(("error", e))
            return
        except Exception as e:  # noqa: BLE001 - this request only
            log.exception("adding request %s failed", stream.id)
            self._drop(stream.id)
            stream.push(("error", RequestFailedError(f"internal error while adding the request: {describe(e)}")))
            return
        self._streams[stream.id] = stream
        req = self.engine.get_request(stream.id)
        stream.push(("accepted", {"prompt_tokens": len(req.prompt_ids) if req is not None else None}))

    def _guarded(self, rid: str, fn, *args) -> None:
        """Run one request's handling; if it raises, fail that request alone."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed on the engine thread", rid)
            stream = self._streams.pop(rid, None)
            self._drop(rid)
            if stream is not None:
                stream.push(("error", RequestFailedError(f"internal error while serving the request: {describe(e)}")))

    def _drop(self, rid: str) -> None:
        """Best effort: make the engine forget a request that failed (frees its slot and pages)."""
        try:
            req = self.engine.get_request(rid)
            if req is not None and req.finish_reason is None:
                self.engine.abort(rid)
        except Exception:  # noqa: BLE001
            log.exception("aborting failed request %s also failed", rid)

    def _abort(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        req = self.engine.get_request(rid)
        if req is None:
            return
        self.engine.abort(rid)
        log.info("request %s aborted after %d tokens", rid, len(req.output_ids))
        self._finish(req, stream)

    def _finish(self, req, stream) -> None:
        result = req.result()
        if self.metrics:
            self.metrics.on_finish(result)
        if stream is not None:
            stream.push(("done", result))

    def _deliver(self, req, ids) -> None:
        """Push one request's new tokens (and its end) to its stream."""
        stream = self._streams.get(req.id)
        if stream is not None and ids:
            k = len(ids)
            lp = (req.logprobs[-k:], req.top_logprobs[-k:]) if req.logprobs is not None else None
            stream.push(("delta", list(ids), req.text, lp))
        if req.finish_reason is not None:  # finished this step
            self._streams.pop(req.id, None)
            self._finish(req, stream)

    def _step(self) -> None:
        t0 = time.perf_counter()
        events = self.engine.step()  # raising here is fatal (see _run)
        dt = time.perf_counter() - t0
        self.total_steps += 1
        ntok = 0
        for req, ids in events:
            ntok += len(ids)
            self._guarded(req.id, self._deliver, req, ids)
        try:
            self._observe(dt, ntok)
        except Exception:  # noqa: BLE001 - metrics must not stop serving
            self._observe_failures += 1
            if self._observe_failures == 1:
                log.exception("recording step metrics failed (logged once)")

    def _observe(self, dt: float, ntok: int) -> None:
        self._rate.add(ntok)
        spec = getattr(self.engine, "stats", None)
        new_rounds = None
        if isinstance(spec, dict) and "samples" in spec:
            # The engine keeps rolling windows; "samples" counts every per-request round ever recorded.
            k = min(spec["samples"] - self._spec_seen, len(spec["accept_lens"]))
            if k > 0:
                tail = lambda key: list(spec[key])[-k:]
                new_rounds = (tail("accept_lens"), tail("verify_lens"), tail("block_accept_lens"))
            self._spec_seen = spec["samples"]
        if self.metrics:
            self.metrics.on_step(dt, ntok, new_rounds)

    def _publish(self) -> None:
        e = self.engine
        pool = e.pool
        used = pool.num_usable_pages - pool.num_free_pages
        snap = {
            "num_running_reqs": len(e.scheduler.running),
            "num_queue_reqs": len(e.scheduler.waiting),
            "kv_used_pages": used,
            "kv_total_pages": pool.num_usable_pages,
            "kv_free_pages": pool.num_free_pages,
            "kv_usage": used / pool.num_usable_pages if pool.num_usable_pages else 0.0,
            "token_capacity": pool.capacity_tokens,
            "last_gen_throughput": self._rate.per_second(),
            "total_steps": self.total_steps,
            "active_streams": len(self._streams),
            # a leak check: every slot is free again once nothing runs
            "free_slots": len(getattr(e.scheduler, "_free_slots", ())),
            "total_slots": e.scheduler.num_slots,
        }
        self.snapshot = snap  # one atomic rebinding: readers see a whole dict
        if self.metrics:
            self.metrics.on_snapshot(snap)
            per_replica = getattr(e, "replica_states", None)  # data-parallel replicas on several hosts
            if per_replica is not None and hasattr(self.metrics, "on_replica_snapshot"):
                for state in per_replica():
                    self.metrics.on_replica_snapshot(state["replica"], state)
