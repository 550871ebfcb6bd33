"""Data parallelism over several hosts: dp_size replicas spread evenly over the --nnodes
processes, each replica on tp_size devices of one host (``mesh.host_replica_groups``), one server
on rank 0.

Tensor parallelism stays on a host's own links and only requests and tokens cross hosts: a
process builds and steps only its own replicas, and no replica's step is collective.  Rank 0
fronts all of them with ``HostReplicas``, one Engine's interface to the server (one EngineLoop):
``add_request`` checks the request against its own first replica (every replica has the same
model and limits), sends it to the replica holding the fewest live requests, and returns at once
with a stand-in Request; the server streams the stand-ins.

Every ``step`` is one tick on every process (the others run ``follow_replicas``):

1. every process contributes one message to a gather (``multihost.allgather_json``): rank 0's
   carries its commands (each request added or aborted since the last tick, for one replica),
   every other's carries what its replicas committed at its previous tick and how loaded they
   are;
2. each process applies the commands for its replicas, then steps every replica of its own that
   has work;
3. rank 0 replays what every replica committed into the stand-ins (``Request.replay``: the same
   ids, cut by the same stop rules, with the replica's logprobs and end).

Ticks are in lockstep, so a tick lasts as long as the slowest host's step, and a remote
replica's tokens reach rank 0 one tick after it committed them.  Requests, seeds and commands
reach each replica in rank 0's order, so a replica commits what a single-process engine given
those requests commits.  While idle, rank 0 ticks about once a second (from ``has_unfinished``,
which the serving loop polls) so the others never wait long in the gather; ``close`` ends every
follower.  A replica that raises on another host stops the server as a local one would: its error
reaches rank 0 with the next gather, and its host exits with an error once rank 0 has closed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Mapping
from types import SimpleNamespace

from dspark_jax.engine.request import Request, Status
from dspark_jax.errors import InvalidRequestError
from dspark_jax.parallel.multihost import HEARTBEAT_S, allgather_json, params_from_json, params_to_json
from dspark_jax.spec.common.stats import new_round_stats, summarize_rounds
from dspark_jax.token_rate import TokenRate

log = logging.getLogger(__name__)

_LOAD_KEYS = ("running", "waiting", "free_pages", "usable_pages", "capacity_tokens", "free_slots", "slots")


def replica_load(engine) -> list[int]:
    """What a replica reports to rank 0 each tick (values in _LOAD_KEYS order)."""
    s, pool = engine.scheduler, engine.pool
    return [len(s.running), len(s.waiting), pool.num_free_pages, pool.num_usable_pages, pool.capacity_tokens,
            len(getattr(s, "_free_slots", ())), s.num_slots]


def run_tick(engines: dict, commands: list, sent_rounds: dict) -> dict:
    """One tick of this process's replicas ({replica index: Engine}): apply rank 0's commands
    for them, step each one with work; returns the message for the next gather (what they
    committed, a record per request that moved, and their loads).  sent_rounds: how many of each
    live request's speculative rounds were reported already."""
    records = []
    for cmd in commands:
        engine = engines.get(cmd[1]) if len(cmd) > 1 else None
        if engine is None:
            continue
        if cmd[0] == "add":
            rid = cmd[4]
            try:
                engine.add_request(cmd[2], params_from_json(cmd[3]), request_id=rid)
            except Exception as e:  # noqa: BLE001 - rank 0 checked it; end this request alone
                log.exception("replica %d could not add request %s", cmd[1], rid)
                records.append({"id": rid, "ids": [], "finish": "abort", "error": f"{type(e).__name__}: {e}"})
        elif cmd[0] == "abort":
            engine.abort(cmd[2])
            sent_rounds.pop(cmd[2], None)
    for engine in engines.values():
        if engine.has_unfinished():
            records += [_record(req, ids, sent_rounds) for req, ids in engine.step()]
    return {"records": records, "loads": [[r, replica_load(e)] for r, e in engines.items()]}


def _record(req: Request, ids, sent_rounds: dict) -> dict:
    k, done = len(ids), req.finish_reason is not None
    start = sent_rounds.pop(req.id, 0) if done else sent_rounds.get(req.id, 0)
    if not done:
        sent_rounds[req.id] = len(req.spec_rounds)
    rec = {"id": req.id, "ids": [int(t) for t in ids], "finish": req.finish_reason,
           "rounds": [[int(x) for x in r] for r in req.spec_rounds[start:]]}
    if req.logprobs is not None and k:
        rec["logprobs"], rec["top"] = req.logprobs[-k:], req.top_logprobs[-k:]
    return rec


class ReplicaHostError(RuntimeError):
    """A replica on another host failed: the whole server stops, as when a local engine fails."""


def follow_replicas(engines: dict) -> int:
    """Run this process's replicas ({replica index: Engine}) under rank 0's commands until rank
    0 closes; returns the ticks run.  If a replica's step raises, the error goes to rank 0 with
    the next gather (which stops serving), and this process raises once rank 0 has closed, so it
    too exits with an error."""
    sent: dict = {}
    message = {"records": [], "loads": [[r, replica_load(e)] for r, e in engines.items()]}
    failed = None
    for ticks in itertools.count():
        commands = allgather_json(message)[0]["commands"]
        if any(c[0] == "stop" for c in commands):
            if failed is not None:
                raise ReplicaHostError(f"this host's replicas failed: {failed}")
            return ticks
        if failed is None:
            try:
                message = run_tick(engines, commands, sent)
            except Exception as e:  # noqa: BLE001 - reported to rank 0, raised at the end
                log.exception("a replica of this host failed; telling rank 0")
                failed = f"{type(e).__name__}: {e}"
        if failed is not None:
            message = {"records": [], "loads": [], "failed": failed}


class _StandIns(Mapping):
    def __init__(self, live: dict):
        self._live = live

    def __getitem__(self, rid: str) -> Request:
        return self._live[rid][1]

    def __iter__(self):
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)


class HostReplicas:
    """Rank 0's front of every replica: the Engine's interface over all of them (attributes it
    does not define are its first local replica's)."""

    def __init__(self, engines: dict, num_replicas: int):
        if not engines or not all(0 <= r < num_replicas for r in engines):
            raise ValueError(f"rank 0 needs replicas among 0..{num_replicas - 1}, got {sorted(engines)}")
        self._local = dict(engines)
        self._first = self._local[min(self._local)]
        self.num_replicas = num_replicas
        self._live: dict[str, tuple[int, Request]] = {}  # request id -> (replica, stand-in)
        self._pending: list = []
        self._sent: dict = {}
        self._loads = {r: replica_load(self._first) for r in range(num_replicas)}  # until each reports
        self._routed = [0] * num_replicas  # requests sent to each replica
        self._rates = [TokenRate() for _ in range(num_replicas)]  # commits that reached rank 0, per replica
        self._rr = itertools.count()
        self._last_tick = time.monotonic()
        self.stats = new_round_stats() if self._first.stats is not None else None

    def __getattr__(self, name):
        if name.startswith("__") or name == "_first":  # (copying, or before __init__ set it)
            raise AttributeError(name)
        return getattr(self._first, name)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt, params=None, request_id: str | None = None) -> str:
        req = self._first.make_request(prompt, params, request_id)  # (every replica has the same limits)
        if req.id in self._live:
            raise InvalidRequestError(f"duplicate request id {req.id!r}")
        replica = self.pick()
        self._live[req.id] = (replica, req)
        self._routed[replica] += 1
        sent = dataclasses.replace(req.params, seed=req.seed)  # the replica draws no seed of its own
        self._pending.append(["add", replica, req.prompt_ids, params_to_json(sent), req.id])
        return req.id

    def pick(self) -> int:
        """The replica holding the fewest live requests (ties: round robin)."""
        held = [0] * self.num_replicas
        for replica, _ in self._live.values():
            held[replica] += 1
        start = next(self._rr) % self.num_replicas
        return min(((start + k) % self.num_replicas for k in range(self.num_replicas)), key=held.__getitem__)

    def replica_of(self, request_id: str) -> int | None:
        entry = self._live.get(request_id)
        return None if entry is None else entry[0]

    def get_request(self, request_id: str) -> Request | None:
        entry = self._live.get(request_id)
        return None if entry is None else entry[1]

    @property
    def _requests(self) -> Mapping:  # Engine.generate's view: the live stand-ins
        return _StandIns(self._live)

    def abort(self, request_id: str) -> None:
        entry = self._live.pop(request_id, None)
        if entry is not None:
            entry[1].finish("abort")
            self._pending.append(["abort", entry[0], request_id])

    def has_unfinished(self) -> bool:
        busy = bool(self._live)
        if not busy and (self._pending or time.monotonic() - self._last_tick > HEARTBEAT_S):
            self.step()  # sends aborts at once; keeps the followers' gather short
        return busy

    # -- ticks ---------------------------------------------------------------------------------
    def step(self) -> list[tuple[Request, list[int]]]:
        """One tick: commands out, every replica's commits in; (stand-in, new ids) for the
        requests that moved, finished ones forgotten."""
        commands, self._pending = self._pending, []
        messages = allgather_json({"commands": commands})
        self._last_tick = time.monotonic()
        events = []
        for rank, message in enumerate(messages[1:], 1):
            if message.get("failed"):
                raise ReplicaHostError(f"the replicas of host {rank} failed: {message['failed']}")
            events += self._take(message)
        events += self._take(run_tick(self._local, commands, self._sent))
        for req, _ in events:
            if req.finish_reason is not None:
                self._live.pop(req.id, None)
        return events

    def _take(self, message: dict) -> list:
        for replica, load in message["loads"]:
            self._loads[replica] = load
        events = []
        for rec in message["records"]:
            entry = self._live.get(rec["id"])
            if entry is None:  # aborted here since
                continue
            req = entry[1]
            if rec.get("error"):
                log.error("request %s failed on replica %d: %s", req.id, entry[0], rec["error"])
            if req.status is Status.WAITING:
                req.status = Status.DECODE
            ids = req.replay(rec["ids"], rec.get("logprobs"), rec.get("top"), rec["finish"])
            rounds = [tuple(r) for r in rec["rounds"]]
            req.spec_rounds += rounds
            if rounds and self.stats is not None:
                acc, win, blk = zip(*rounds)
                self.stats["accept_lens"].extend(acc)
                self.stats["verify_lens"].extend(win)
                self.stats["block_accept_lens"].extend(blk)
                self.stats["samples"] += len(rounds)
            events.append((req, ids))
            self._rates[entry[0]].add(len(ids))
        return events

    def summary(self) -> dict:
        """Every replica's speculative rounds, as they reported them with their tokens."""
        worker = self._first.worker
        if self.stats is None:
            return {}
        rounds = summarize_rounds(self.stats, worker.gamma)
        del rounds["rounds"]  # (batch rounds are each replica's own; only per-request rounds travel)
        return {"algorithm": worker.name, "replicas": self.num_replicas, **rounds}

    def settle(self) -> None:
        """(Each replica settles its own step in flight at its next tick.)"""

    def generate(self, prompts, sampling=None):
        """Engine.generate over every replica."""
        from dspark_jax.engine.engine import Engine

        return Engine.generate(self, prompts, sampling)

    def close(self) -> None:
        """End every follower (their replicas stay as they are)."""
        allgather_json({"commands": [["stop"]]})

    # -- what the server reads -----------------------------------------------------------------
    def replica_states(self) -> list[dict]:
        """Each replica's last reported load, how many requests it was sent, and the gauges the
        server's metrics keep per replica (tokens/s of the commits that reached rank 0)."""
        states = []
        for r in range(self.num_replicas):
            load = dict(zip(_LOAD_KEYS, self._loads[r]))
            used = load["usable_pages"] - load["free_pages"]
            states.append({"replica": r, **load, "routed_requests": self._routed[r],
                           "num_running_reqs": load["running"], "num_queue_reqs": load["waiting"],
                           "kv_used_pages": used, "kv_usage": used / load["usable_pages"] if load["usable_pages"] else 0.0,
                           "last_gen_throughput": self._rates[r].per_second()})
        return states

    def _total(self, key: str) -> int:
        i = _LOAD_KEYS.index(key)
        return sum(load[i] for load in self._loads.values())

    @property
    def pool(self):
        """The pages of every replica, summed (a request's own need is checked in add_request)."""
        first = self._first.pool
        return SimpleNamespace(num_free_pages=self._total("free_pages"), num_usable_pages=self._total("usable_pages"),
                               capacity_tokens=self._total("capacity_tokens"), page_size=first.page_size,
                               num_pages=first.num_pages * self.num_replicas)

    @property
    def scheduler(self):
        """Requests and slots of every replica, summed (as counts)."""
        return SimpleNamespace(running=range(self._total("running")), waiting=range(self._total("waiting")),
                               _free_slots=range(self._total("free_slots")), num_slots=self._total("slots"))
