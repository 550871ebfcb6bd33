"""The engine thread: the one thread that owns the (not thread-safe) Engine.

The HTTP event loop talks to it only through a thread-safe command queue (submit, abort,
abort-all, stop).  Each submitted request gets a `RequestStream`: an asyncio queue on the HTTP
loop that the engine thread feeds with `loop.call_soon_threadsafe`.  Events, in order:

    ("accepted", {"prompt_tokens": n})   the engine validated and queued the request
    ("error", InvalidRequestError)       it did not (nothing else follows)
    ("delta", new_ids, text_so_far)      tokens committed by one engine step
    ("done", GenerationResult)           finished (stop, length or abort); nothing follows

Between commands the thread runs `engine.step()` while there is work (continuous batching: the
engine admits queued requests as slots and KV pages free up) and publishes a `snapshot` dict
(running/queued counts, KV usage, throughput) that the HTTP side reads without locking.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import uuid

from dspark_jax.errors import InvalidRequestError
from dspark_jax.sampling import SamplingParams

log = logging.getLogger(__name__)


class RequestStream:
    """The HTTP side of one request: events pushed by the engine thread."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.id = request_id
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def push(self, event: tuple) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the HTTP loop is closed (shutdown): nobody listens any more
            pass

    async def get(self) -> tuple:
        ev = await self._queue.get()
        if ev[0] in ("done", "error"):
            self.finished = True
        return ev


class EngineLoop:
    def __init__(self, engine, metrics=None, *, throughput_window_s: float = 2.0):
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        self._window = throughput_window_s
        self._recent: collections.deque = collections.deque()  # (time, tokens) for throughput
        self._spec_seen = 0
        self.total_steps = 0
        self.snapshot: dict = {}
        self._publish()

    # -- HTTP side (any thread) ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, prompt, params: SamplingParams, loop: asyncio.AbstractEventLoop, prefix: str = "req") -> RequestStream:
        stream = RequestStream(f"{prefix}-{uuid.uuid4().hex[:24]}", loop)
        if not self.alive:
            stream.push(("error", RuntimeError("the engine thread is not running")))
        else:
            self._commands.put(("add", stream, prompt, params))
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        self._commands.put(("abort_all",))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything and end the thread."""
        self._commands.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout)

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
            log.exception("engine thread crashed")
            self.error = e
        finally:
            for rid, stream in list(self._streams.items()):
                try:
                    self._abort(rid)
                except Exception:  # noqa: BLE001 - the engine may be what broke: still release the client
                    log.exception("aborting %s failed", rid)
                    self._streams.pop(rid, None)
                    stream.push(("error", RuntimeError("the engine stopped")))
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
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, stream, prompt, params = cmd
            try:
                self.engine.add_request(prompt, params, request_id=stream.id)
            except InvalidRequestError as e:
                stream.push(("error", e))
                return
            req = self._request(stream.id)
            self._streams[stream.id] = stream
            stream.push(("accepted", {"prompt_tokens": len(req.prompt_ids) if req else None}))
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "abort_all":
            for rid in list(self._streams):
                self._abort(rid)
        elif kind == "stop":
            self._stopped.set()

    def _request(self, rid):
        return self.engine.get_request(rid)

    def _abort(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        req = self._request(rid)
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

    def _step(self) -> None:
        t0 = time.perf_counter()
        events = self.engine.step()
        dt = time.perf_counter() - t0
        self.total_steps += 1
        ntok = 0
        for req, ids in events:
            ntok += len(ids)
            stream = self._streams.get(req.id)
            if stream is not None and ids:
                stream.push(("delta", list(ids), req.text))
            if req.finish_reason is not None:  # finished this step
                self._streams.pop(req.id, None)
                self._finish(req, stream)
        now = time.perf_counter()
        self._recent.append((now, ntok))
        while self._recent and now - self._recent[0][0] > self._window:
            self._recent.popleft()
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
        t = time.perf_counter()
        while self._recent and t - self._recent[0][0] > self._window:  # idle: throughput decays to 0
            self._recent.popleft()
        if len(self._recent) >= 2:
            span = self._recent[-1][0] - self._recent[0][0]
            toks = sum(n for _, n in list(self._recent)[1:])
            tput = toks / span if span > 0 else 0.0
        else:
            tput = 0.0
        snap = {
            "num_running_reqs": len(e.scheduler.running),
            "num_queue_reqs": len(e.scheduler.waiting),
            "kv_used_pages": used,
            "kv_total_pages": pool.num_usable_pages,
            "kv_free_pages": pool.num_free_pages,
            "kv_usage": used / pool.num_usable_pages if pool.num_usable_pages else 0.0,
            "token_capacity": pool.capacity_tokens,
            "last_gen_throughput": tput,
            "total_steps": self.total_steps,
            "active_streams": len(self._streams),
        }
        self.snapshot = snap  # one atomic rebinding: readers see a whole dict
        if self.metrics:
            self.metrics.on_snapshot(snap)
