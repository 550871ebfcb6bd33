"""Data parallelism behind the server: several engine replicas, one EngineLoop each.

``ReplicaRouter`` stands where the server's EngineLoop stands (the same calls: start, submit,
abort, abort_all, stop, alive, error, thread, snapshot) and sends each new request to the
least-loaded replica: the fewest requests it holds (running and queued: its loop's live streams)
plus the requests submitted to it that its engine thread has not picked up yet; ties go round
robin.  Each replica is a whole engine on its own tp_size devices (``EngineConfig.dp_size``,
``dspark_jax.parallel.mesh.replica_device_groups``), with its own KV pool, scheduler and engine
thread, so replicas never wait on each other.

Metrics: counters (requests, tokens, steps, latencies) are the server's, shared; the gauges of
the usual names report the sum over replicas, and ``dspark:replica_*`` gauges carry a
``replica`` label.  ``/server_info`` lists one internal state per replica.
"""

from __future__ import annotations

import itertools
import threading

from serving.engine_loop import EngineLoop

_SUMMED = ("num_running_reqs", "num_queue_reqs", "kv_used_pages", "kv_total_pages", "kv_free_pages",
           "token_capacity", "last_gen_throughput", "total_steps", "active_streams")


def combine_snapshots(snaps: list[dict]) -> dict:
    """The server-wide snapshot: counts summed, KV usage over the pooled pages."""
    out = {k: sum(s.get(k, 0) for s in snaps) for k in _SUMMED}
    out["kv_usage"] = out["kv_used_pages"] / out["kv_total_pages"] if out["kv_total_pages"] else 0.0
    return out


class _ReplicaMetrics:
    """One replica's hooks into the server's metrics."""

    def __init__(self, router: ReplicaRouter, index: int):
        self.router, self.index = router, index

    def on_step(self, seconds, tokens, spec_rounds=None):
        if self.router.metrics is not None:
            self.router.metrics.on_step(seconds, tokens, spec_rounds)

    def on_finish(self, result):
        if self.router.metrics is not None:
            self.router.metrics.on_finish(result)

    def on_snapshot(self, snap):
        self.router._on_snapshot(self.index, snap)


class ReplicaRouter:
    def __init__(self, engines, metrics=None, *, on_fatal=None, throughput_window_s: float = 2.0):
        if not engines:
            raise ValueError("a replica router needs at least one engine")
        self.metrics = metrics
        self._lock = threading.Lock()
        self._snaps: dict[int, dict] = {}
        self._owner: dict[str, tuple[int, object]] = {}  # request id -> (replica, stream)
        self._rr = itertools.count()
        self.loops = [EngineLoop(e, _ReplicaMetrics(self, i), on_fatal=on_fatal, throughput_window_s=throughput_window_s)
                      for i, e in enumerate(engines)]

    # -- what the server calls ------------------------------------------------------------------
    @property
    def engines(self):
        return [lp.engine for lp in self.loops]

    def start(self) -> None:
        for lp in self.loops:
            lp.start()

    @property
    def thread(self):
        return self.loops[0].thread

    @property
    def alive(self) -> bool:
        return all(lp.alive for lp in self.loops)

    @property
    def error(self):
        return next((lp.error for lp in self.loops if lp.error is not None), None)

    @property
    def snapshot(self) -> dict:
        return combine_snapshots([lp.snapshot for lp in self.loops])

    @property
    def total_steps(self) -> int:
        return sum(lp.total_steps for lp in self.loops)

    def load(self, i: int) -> int:
        """Requests replica i holds or has been sent and not yet picked up."""
        lp = self.loops[i]
        return int(lp.snapshot.get("active_streams", 0)) + lp._commands.qsize()

    def pick(self) -> int:
        """The least-loaded live replica (ties: round robin)."""
        n = len(self.loops)
        start = next(self._rr) % n
        order = [(start + k) % n for k in range(n)]
        live = [i for i in order if self.loops[i].alive] or order
        return min(live, key=self.load)

    def submit(self, prompt_ids, params, loop, prefix: str = "req", queue=None, index: int = 0):
        with self._lock:
            i = self.pick()
            stream = self.loops[i].submit(prompt_ids, params, loop, prefix, queue, index)
            self._owner[stream.id] = (i, stream)
            if len(self._owner) > 4 * 1024:  # forget requests whose stream has ended
                self._owner = {k: v for k, v in self._owner.items() if not v[1].finished}
        return stream

    def replica_of(self, request_id: str) -> int | None:
        owner = self._owner.get(request_id)
        return None if owner is None else owner[0]

    def abort(self, request_id: str) -> None:
        i = self.replica_of(request_id)
        for lp in (self.loops if i is None else [self.loops[i]]):
            lp.abort(request_id)

    def abort_all(self) -> None:
        for lp in self.loops:
            lp.abort_all()

    def stop(self, timeout: float = 10.0) -> None:
        for lp in self.loops:
            lp._commands.put(("stop",))
        for lp in self.loops:
            lp.stop(timeout)

    # -- metrics ---------------------------------------------------------------------------------
    def _on_snapshot(self, index: int, snap: dict) -> None:
        with self._lock:
            self._snaps[index] = snap
            total = combine_snapshots(list(self._snaps.values()))
        if self.metrics is not None:
            self.metrics.on_snapshot(total)
            if hasattr(self.metrics, "on_replica_snapshot"):
                self.metrics.on_replica_snapshot(index, snap)
