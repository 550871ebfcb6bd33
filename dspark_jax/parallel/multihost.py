"""Several hosts: one JAX process per host, one engine spanning them, rank 0 in charge.

``initialize`` joins the processes (``jax.distributed.initialize`` from --nnodes, --node-rank and
--dist-init-addr; on CPU with gloo collectives).  Every process then builds the same engine over
the global devices (a tensor-parallel mesh may span hosts) and must call the same compiled steps,
in the same order, with the same host inputs.  The engine's host side is deterministic given its
requests, so it is enough that every process sees the same requests at the same steps:

- rank 0 wraps its engine in ``LeaderEngine``: every accepted ``add_request`` (with the seed it
  drew) and every ``abort`` is recorded, and each ``step`` first broadcasts the recorded commands
  to the other processes (``multihost_utils.broadcast_one_to_all``), then steps;
- every other rank runs ``follow(engine)``: receive the commands, replay them, step; until rank 0
  broadcasts "stop" (``LeaderEngine.close``).

While idle, rank 0 broadcasts an empty command list about once a second (from
``has_unfinished``, which the serving loop polls), so the followers' collective never waits long.
Only rank 0 serves HTTP.  Timing must not steer what is computed: a DSpark cost table is profiled
on every host alike, then every host schedules by rank 0's fit (``broadcast_json``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time

import numpy as np

from dspark_jax.sampling import SamplingParams

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


def initialize(nnodes: int, node_rank: int, dist_init_addr: str | None) -> bool:
    """Join the nnodes processes (before anything else touches JAX); False for one node."""
    if nnodes <= 1:
        return False
    import jax

    if not dist_init_addr:
        raise ValueError("several nodes need dist_init_addr (host:port of rank 0's coordinator)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes; GPUs use NCCL
    jax.distributed.initialize(coordinator_address=dist_init_addr, num_processes=nnodes, process_id=node_rank)
    log.info("process %d of %d joined at %s: %d devices, %d local", jax.process_index(), jax.process_count(),
             dist_init_addr, jax.device_count(), jax.local_device_count())
    return True


def _buffer_size(nbytes: int) -> int:
    """The byte buffer a payload travels in: a power of two, at least 256 (a few buffer sizes,
    so the collectives compile a few times)."""
    return max(256, 1 << (nbytes - 1).bit_length())


def broadcast_json(value):
    """Rank 0's JSON-able value on every process (what the others pass is ignored)."""
    import jax
    from jax.experimental import multihost_utils

    leader = jax.process_index() == 0
    payload = json.dumps(value).encode() if leader else b""
    n = multihost_utils.broadcast_one_to_all(np.array([len(payload)], np.int32), is_source=leader)
    size = _buffer_size(int(n[0]))
    buf = np.zeros(size, np.uint8)
    if leader:
        buf[:len(payload)] = np.frombuffer(payload, np.uint8)
    buf = multihost_utils.broadcast_one_to_all(buf, is_source=leader)
    return value if leader else json.loads(bytes(np.asarray(buf)[:int(n[0])]).decode())


def allgather_json(value) -> list:
    """Every process's JSON-able value, in rank order, on every process."""
    import jax
    from jax.experimental import multihost_utils

    payload = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([payload.size], np.int32))).reshape(-1)
    size = _buffer_size(int(sizes.max()))
    buf = np.zeros(size, np.uint8)
    buf[:payload.size] = payload
    bufs = np.asarray(multihost_utils.process_allgather(buf)).reshape(jax.process_count(), size)
    return [json.loads(bytes(bufs[r, :int(sizes[r])]).decode()) for r in range(jax.process_count())]


def params_to_json(params: SamplingParams) -> dict:
    """A request's SamplingParams as JSON (its compiled grammar left out: each process compiles
    its own)."""
    return dataclasses.asdict(dataclasses.replace(params, compiled_grammar=None))


def params_from_json(d: dict) -> SamplingParams:
    d = dict(d)
    d["stop_token_ids"], d["stop"] = tuple(d["stop_token_ids"]), tuple(d["stop"])
    if d.get("grammar") is not None:
        d["grammar"] = tuple(d["grammar"])
    return SamplingParams(**d)


def check_same_engine_args(args: dict) -> None:
    """Raise on every process unless all were started with the same engine arguments (a JSON-able
    dict).  A rank whose engine differs would otherwise compile other steps and leave the rest
    waiting inside a collective.  Every rank gathers every rank's digest, so all of them decide
    alike; each names the fields where it differs from rank 0."""
    import jax
    from jax.experimental import multihost_utils

    text = json.dumps(args, sort_keys=True, default=str)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(jax.process_count(), -1)
    leader = broadcast_json(json.loads(text))
    differ = [r for r in range(len(digests)) if not np.array_equal(digests[r], digests[0])]
    if differ:
        mine = sorted(k for k in set(leader) | set(args) if json.dumps(leader.get(k), default=str) !=
                      json.dumps(args.get(k), default=str))
        raise ValueError(f"rank(s) {differ} were started with engine arguments other than rank 0's"
                         + (f"; this rank differs in {', '.join(mine)}" if mine else "")
                         + ": start every node with the same flags but --node-rank")


class LeaderEngine:
    """Rank 0's engine: the Engine's interface, its requests replayed on every other rank."""

    def __init__(self, engine):
        self._engine = engine
        self._pending: list = []
        self._last_broadcast = time.monotonic()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        rid = self._engine.add_request(prompt, params, request_id)
        req = self._engine.get_request(rid)
        # the followers draw no seeds of their own, and compile a grammar themselves
        sent = dataclasses.replace(req.params, seed=req.seed)
        self._pending.append(["add", list(map(int, req.prompt_ids)), params_to_json(sent), rid])
        return rid

    def abort(self, request_id: str) -> None:
        self._engine.abort(request_id)
        self._pending.append(["abort", request_id])

    def _send(self, tail: list) -> None:
        commands, self._pending = self._pending + [tail], []
        broadcast_json(commands)
        self._last_broadcast = time.monotonic()

    def step(self):
        self._send(["step"])
        return self._engine.step()

    def has_unfinished(self) -> bool:
        busy = self._engine.has_unfinished()
        if not busy and (self._pending or time.monotonic() - self._last_broadcast > HEARTBEAT_S):
            self._send(["idle"])  # replays aborts at once; keeps the followers' collective short
        return busy

    def _drain(self):  # Engine.generate settles the step in flight: so must every rank
        self._pending.append(["drain"])
        return self._engine._drain()

    def _release_finished(self) -> None:
        self._pending.append(["release"])
        self._engine._release_finished()

    def generate(self, prompts, sampling=None):
        """Engine.generate through this engine (its requests replayed on every rank)."""
        from dspark_jax.engine.engine import Engine

        return Engine.generate(self, prompts, sampling)

    def close(self) -> None:
        """Tell the followers to return."""
        self._send(["stop"])


def follow(engine) -> int:
    """Run rank 0's requests on this rank's part of the engine until rank 0 closes; returns the
    steps run."""
    steps = 0
    while True:
        for cmd in broadcast_json(None):
            kind = cmd[0]
            if kind == "add":
                engine.add_request(cmd[1], params_from_json(cmd[2]), request_id=cmd[3])
            elif kind == "abort":
                engine.abort(cmd[1])
            elif kind == "drain":
                engine._drain()
            elif kind == "release":
                engine._release_finished()
            elif kind == "step":
                engine.step()
                steps += 1
            elif kind == "stop":
                return steps
