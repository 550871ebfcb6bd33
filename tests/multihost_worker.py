"""One process of the two-process tests (tests/test_parallel.py, tests/test_multihost_args.py):
joins the other over localhost (gloo), builds a TP 2 engine spanning both processes' CPU devices
and writes rank 0's tokens as JSON.  Usage: python tests/multihost_worker.py RANK PORT OUT_JSON
[check-args | derive-table | host-replicas] (instead, each rank writing OUT_JSON.RANK: check-args,
the cross-rank engine-argument check; derive-table, a compact engine deriving its cost table on
both ranks; host-replicas, two TP 2 replicas, one per process, rank 0 fronting both).
``run_two_ranks`` starts both ranks from a test."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_two_ranks(out: Path, *extra: str, timeout: float = 900, devices: int = 1) -> None:
    """Run this script as ranks 0 and 1 on a free localhost port, ``devices`` CPU devices each;
    fails the calling test with both logs unless both exit 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(out), *extra], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n=====\n".join(x[-4000:] for x in logs)


def record_request_ids(engine, into: list) -> None:
    """Append the id of every request added to ``engine`` to ``into`` (which replica got what)."""
    real = engine.add_request
    engine.add_request = lambda *a, **k: into.append(k["request_id"]) or real(*a, **k)


def main(rank: int, port: int, out: str) -> None:
    from dspark_jax.parallel.multihost import initialize

    initialize(2, rank, f"127.0.0.1:{port}")
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.parallel.multihost import LeaderEngine, follow
    from dspark_jax.spec.config import SpeculativeConfig
    from tests.test_mtp_engine import scaled_target
    from tests.test_parallel import EC, GREEDY, SEEDED, V, _prompts
    from tests.test_speculative_engine import repeat_biased_drafter

    assert jax.process_count() == 2 and jax.device_count() == 2 and jax.local_device_count() == 1
    target = scaled_target(vocab=V, attention_bias=True)
    prompts = _prompts()
    plain = Engine(target, None, EngineConfig(**EC, tp_size=2))
    assert plain.parallel.devices == jax.devices()
    result = {"spmd": [r.token_ids for r in plain.generate(prompts, GREEDY)]}  # every rank the same calls
    dspark = Engine(target, None, EngineConfig(**EC, tp_size=2), drafter=repeat_biased_drafter(target),
                    spec=SpeculativeConfig(mode="static"))
    for name, eng in (("plain", plain), ("dspark", dspark)):
        if rank == 0:  # rank 0 decides; rank 1 replays its requests and steps
            lead = LeaderEngine(eng)
            result[name] = [r.token_ids for r in lead.generate(prompts, GREEDY)]
            result[name + "_seeded"] = [r.token_ids for r in lead.generate(prompts[:2], SEEDED)]
            lead.close()
        else:
            follow(eng)
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def check_args(rank: int, port: int, out: str) -> None:
    """The engine-argument check: equal arguments pass, then rank 1 brings a different one."""
    from dspark_jax.parallel.multihost import check_same_engine_args, initialize
    from dspark_jax.server_args import ServerArgs

    initialize(2, rank, f"127.0.0.1:{port}")
    same = ServerArgs(nnodes=2, node_rank=rank, dist_init_addr=f"127.0.0.1:{port}", port=30000 + rank)
    check_same_engine_args(same.engine_args())  # only node_rank and the HTTP port differ
    other = dataclasses.replace(same, max_running_requests=8 if rank else 16)
    try:
        check_same_engine_args(other.engine_args())
        message = None
    except ValueError as e:
        message = str(e)
    Path(f"{out}.{rank}").write_text(json.dumps(message))


def derive_table(rank: int, port: int, out: str) -> None:
    """A compact TP 2 engine derives its cost table on both ranks (profiled together), then again
    where only rank 0 has it cached; each rank writes the tables it got and the greedy tokens
    committed with them, rank 0 leading."""
    from dspark_jax.parallel.multihost import initialize

    initialize(2, rank, f"127.0.0.1:{port}")
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.parallel.multihost import LeaderEngine, follow
    from dspark_jax.spec.config import SpeculativeConfig
    from dspark_jax.spec.dspark.profile import derive_cost_table
    from tests.test_mtp_engine import scaled_target
    from tests.test_parallel import EC, GREEDY, V, _prompts
    from tests.test_speculative_engine import repeat_biased_drafter

    target = scaled_target(vocab=V, attention_bias=True)
    eng = Engine(target, None, EngineConfig(**EC, tp_size=2), drafter=repeat_biased_drafter(target),
                 spec=SpeculativeConfig(mode="compact"))
    profiled = derive_cost_table(eng.worker, f"{out}.tables{rank}")
    cached = derive_cost_table(eng.worker, f"{out}.tables{rank if rank == 0 else 'empty'}")
    eng.worker.use_table(profiled)
    tokens = None
    if rank == 0:
        lead = LeaderEngine(eng)
        tokens = [r.token_ids for r in lead.generate(_prompts(), GREEDY)]
        lead.close()
    else:
        follow(eng)
    Path(f"{out}.{rank}").write_text(json.dumps({"profiled": profiled.to_dict(), "cached": cached.to_dict(),
                                                 "tokens": tokens}))


def host_replicas(rank: int, port: int, out: str) -> None:
    """Two TP 2 replicas, one on each process's two devices, rank 0 fronting both (HostReplicas)
    and rank 1 following: plain and DSpark compact, greedy, seeded and with logprobs, and one
    request aborted mid-way.  Each rank writes what rank 0 got and the request ids its own replica
    was given."""
    from dspark_jax.parallel.multihost import initialize

    initialize(2, rank, f"127.0.0.1:{port}")
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.parallel.host_replicas import HostReplicas, follow_replicas
    from dspark_jax.parallel.mesh import host_replica_groups
    from dspark_jax.sampling import SamplingParams
    from dspark_jax.spec.config import SpeculativeConfig
    from tests.test_mtp_engine import scaled_target
    from tests.test_parallel import EC, GREEDY, SEEDED, V, _prompts
    from tests.test_speculative_engine import TABLE, repeat_biased_drafter

    assert jax.process_count() == 2 and jax.local_device_count() == 2
    groups = host_replica_groups(2, 2)
    mine = {r: g for r, g in enumerate(groups) if g[0].process_index == rank}
    assert list(mine) == [rank] and all(d.process_index == rank for d in mine[rank])
    target = scaled_target(vocab=V, attention_bias=True)
    arms = {"plain": {}, "compact": dict(drafter=repeat_biased_drafter(target),
                                         spec=SpeculativeConfig(mode="compact", cost_table=TABLE))}
    prompts, logprobs = _prompts(), SamplingParams(max_new_tokens=6, logprobs=3, ignore_eos=True)
    result = {}
    for name, kw in arms.items():
        engines = {r: Engine(target, None, EngineConfig(**EC, tp_size=2), devices=g, **kw) for r, g in mine.items()}
        for e in engines.values():
            record_request_ids(e, result.setdefault(name + "_added", []))
        if rank != 0:
            follow_replicas(engines)
            continue
        front = HostReplicas(engines, 2)
        result[name] = [r.token_ids for r in front.generate(prompts, GREEDY)]
        long = front.add_request(prompts[0], SamplingParams(max_new_tokens=60, ignore_eos=True))
        while not front.get_request(long).output_ids:
            front.step()
        req = front.get_request(long)
        front.abort(long)
        result[name + "_aborted"] = [req.finish_reason, len(req.output_ids)]
        result[name + "_seeded"] = [r.token_ids for r in front.generate(prompts[:2], SEEDED)]
        lp = front.generate(prompts[:2], logprobs)
        result[name + "_logprobs"] = [[r.token_ids, r.logprobs, r.top_logprobs] for r in lp]
        for _ in range(2):  # ticks that carry the abort and report the loads
            front.step()
        result[name + "_states"] = front.replica_states()
        result[name + "_summary"] = front.summary()
        front.close()
    Path(f"{out}.{rank}").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.environ["JAX_PLATFORMS"] = "cpu"
    modes = {"check-args": check_args, "derive-table": derive_table, "host-replicas": host_replicas}
    mode = modes.get(sys.argv[4] if sys.argv[4:] else "", main)
    mode(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
