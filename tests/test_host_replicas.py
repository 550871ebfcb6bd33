"""Data parallelism over several hosts (dspark_jax/parallel/host_replicas.py): rank 0's front sends
each request to one replica and replays what the replica committed into a stand-in request.

The reference is one engine given the same requests: a replica is such an engine, so the front
must return its tokens, text, finish reasons and logprobs exactly.  In one process the front
drives two local replicas through the same gather a multi-host run uses (over one process); two
processes on localhost (gloo) run one TP 2 replica each, rank 0 fronting both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.parallel.host_replicas import HostReplicas
from dspark_jax.sampling import SamplingParams
from tests.multihost_worker import record_request_ids
from tests.tiny_engines import EC

PROMPTS = [[5, 17, 33, 9], [101, 7], [250, 251, 252, 253, 254, 8], [3] * 9, [44, 45], [60, 61, 62]]


def _replicas(model_dir, n=2):
    """n replicas on this process, each recording the request ids it was given."""
    engines, given = {}, {}
    for r in range(n):
        e = Engine.from_pretrained(model_dir, EngineConfig(**EC))
        record_request_ids(e, given.setdefault(r, []))
        engines[r] = e
    return engines, given


def test_front_returns_what_one_engine_returns(model_dir, plain):
    """Greedy, seeded sampling, stop strings and logprobs over two replicas: every result equals
    the single engine's (logprobs up to the rounding of another batch shape), and both replicas
    served."""
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
    text = plain.generate([PROMPTS[0]], greedy)[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]  # a stop string the greedy text reaches
    params = [SamplingParams(max_new_tokens=16, stop=(stop,), ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True), greedy,
              SamplingParams(max_new_tokens=8, logprobs=3, ignore_eos=True),
              SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=8, logprobs=2),
              SamplingParams(max_new_tokens=5)]
    engines, given = _replicas(model_dir)
    front = HostReplicas(engines, 2)
    got = front.generate(PROMPTS, params)
    want = plain.generate(PROMPTS, params)
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        if w.logprobs is not None:  # (another batch, another bucket: float rounding apart)
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
            assert [[t for t, _ in row] for row in g.top_logprobs] == [[t for t, _ in row] for row in w.top_logprobs]
        else:
            assert g.logprobs is g.top_logprobs is None
        assert g.stats["completion_tokens"] == len(w.token_ids)
    assert got[0].finish_reason == "stop" and stop not in got[0].text
    assert sorted(given[0] + given[1]) == sorted(g.request_id for g in got)
    assert len(given[0]) == len(given[1]) == 3  # an empty front alternates


def test_the_least_loaded_replica_gets_the_next_request(model_dir):
    engines, given = _replicas(model_dir)
    front = HostReplicas(engines, 2)
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    first = front.add_request(PROMPTS[0], long)
    second = front.add_request(PROMPTS[1], long)
    emptied = front.replica_of(first)
    assert {emptied, front.replica_of(second)} == {0, 1}
    front.abort(first)
    assert [front.pick() for _ in range(3)] == [emptied] * 3  # not the round robin's turn
    third = front.add_request(PROMPTS[2], long)
    assert front.replica_of(third) == emptied
    while front.has_unfinished():
        front.step()
    assert given[emptied] == [first, third]  # the aborted one reached it, and went


def test_abort_ends_the_request_on_its_replica(model_dir, plain):
    """An aborted request finishes at once with reason "abort"; the next tick takes it off its
    replica (slot and pages back), and the replicas go on serving."""
    engines, _ = _replicas(model_dir)
    front = HostReplicas(engines, 2)
    rid = front.add_request(PROMPTS[3], SamplingParams(max_new_tokens=60, ignore_eos=True))
    while not front.get_request(rid).output_ids:
        front.step()
    req, replica = front.get_request(rid), front.replica_of(rid)
    assert engines[replica].get_request(rid) is not None
    front.abort(rid)
    assert req.result().finish_reason == "abort" and front.get_request(rid) is None
    assert not front.has_unfinished()  # (and its tick sends the abort)
    assert engines[replica].get_request(rid) is None and not engines[replica].scheduler.running
    pool = engines[replica].pool
    assert pool.num_free_pages == pool.num_usable_pages
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in front.generate(PROMPTS[:2], greedy)] == \
        [r.token_ids for r in plain.generate(PROMPTS[:2], greedy)]
    states = front.replica_states()
    assert [s["replica"] for s in states] == [0, 1] and all(s["running"] == 0 for s in states)
    assert front.pool.num_usable_pages == 2 * pool.num_usable_pages


def test_bad_requests_are_refused_by_the_front(model_dir):
    from dspark_jax.errors import InvalidRequestError

    engines, given = _replicas(model_dir)
    front = HostReplicas(engines, 2)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        front.add_request([10**6])
    with pytest.raises(InvalidRequestError, match="context"):
        front.add_request([5] * EC["max_model_len"])
    rid = front.add_request([5], SamplingParams(max_new_tokens=2), request_id="x")
    with pytest.raises(InvalidRequestError, match="duplicate"):
        front.add_request([6], request_id=rid)
    while front.has_unfinished():
        front.step()
    assert given[0] + given[1] == ["x"]


def test_a_failing_host_stops_the_server_and_then_itself(model_dir, monkeypatch):
    """A replica whose step raises on another host: the error reaches rank 0 with the next
    gather, where step() raises it (the serving loop then fails every request and the server
    exits), and the failed host raises once rank 0 has closed, so both exit with an error."""
    from dspark_jax.parallel import host_replicas as hr
    from dspark_jax.parallel.multihost import params_to_json

    add = ["add", 1, [5, 6], params_to_json(SamplingParams(max_new_tokens=3)), "a"]
    commands, sent = iter([[add], [], [["stop"]]]), []

    def gather(message):  # rank 0's commands, this host's message
        sent.append(message)
        return [{"commands": next(commands)}, message]

    monkeypatch.setattr(hr, "allgather_json", gather)
    engine = Engine.from_pretrained(model_dir, EngineConfig(**EC))
    monkeypatch.setattr(engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(hr.ReplicaHostError, match="device lost"):
        hr.follow_replicas({1: engine})
    assert "failed" not in sent[0] and sent[1]["failed"] == sent[2]["failed"] == "RuntimeError: device lost"

    engines, _ = _replicas(model_dir, 1)
    front = HostReplicas(engines, 2)
    rid = front.add_request([5, 6])
    monkeypatch.setattr(hr, "allgather_json", lambda m: [m, {"records": [], "loads": [], "failed": "RuntimeError: x"}])
    with pytest.raises(hr.ReplicaHostError, match="host 1 failed: RuntimeError: x"):
        front.step()
    assert front.get_request(rid) is not None  # nothing was taken as finished


def test_layout_and_flags_are_checked():
    import jax

    from dspark_jax.parallel.mesh import host_replica_groups
    from dspark_jax.server_args import ServerArgs

    n = jax.device_count()
    assert host_replica_groups(1, n) == [[d] for d in jax.devices()]
    with pytest.raises(ValueError, match="devices on every host"):
        host_replica_groups(1, n + 1)
    with pytest.raises(ValueError, match="multiple of --nnodes"):
        ServerArgs(nnodes=2, dist_init_addr="h:1", dp_size=3, speculative_algorithm="NONE").resolve()
    args = ServerArgs(nnodes=2, dist_init_addr="h:1", dp_size=4, speculative_algorithm="NONE").resolve()
    assert args.engine_config().dp_size == 4


@pytest.mark.slow
def test_two_hosts_one_tp2_replica_each(tmp_path):
    """Two processes, two CPU devices each: one TP 2 replica per process, rank 0 fronting both
    (plain and DSpark compact).  Rank 0 gets the single-device tokens (greedy, seeded) and
    logprobs, each replica was given requests, and an aborted request leaves no trace."""
    from dspark_jax.spec.config import SpeculativeConfig
    from tests.multihost_worker import run_two_ranks
    from tests.test_mtp_engine import scaled_target
    from tests.test_parallel import EC as PEC
    from tests.test_parallel import GREEDY, SEEDED, V, _prompts
    from tests.test_speculative_engine import TABLE, repeat_biased_drafter

    out = tmp_path / "replicas"
    run_two_ranks(out, "host-replicas", devices=2)
    got = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    lead = got[0]
    target = scaled_target(vocab=V, attention_bias=True)
    prompts = _prompts()
    lp_params = SamplingParams(max_new_tokens=6, logprobs=3, ignore_eos=True)
    arms = {"plain": {}, "compact": dict(drafter=repeat_biased_drafter(target),
                                         spec=SpeculativeConfig(mode="compact", cost_table=TABLE))}
    for name, kw in arms.items():
        one = Engine(target, None, EngineConfig(**PEC), **kw)
        assert lead[name] == [r.token_ids for r in one.generate(prompts, GREEDY)], name
        assert lead[name + "_seeded"] == [r.token_ids for r in one.generate(prompts[:2], SEEDED)], name
        for (ids, lps, top), w in zip(lead[name + "_logprobs"], one.generate(prompts[:2], lp_params)):
            assert ids == w.token_ids
            assert lps == pytest.approx(w.logprobs, abs=1e-4)
            assert [[t for t, _ in row] for row in top] == [[t for t, _ in row] for row in w.top_logprobs]
        reason, n = lead[name + "_aborted"]
        assert reason == "abort" and 0 < n < 60
        assert all(s["running"] == s["waiting"] == 0 and s["free_slots"] == s["slots"] for s in lead[name + "_states"])
        given = [got[r][name + "_added"] for r in (0, 1)]
        assert given[0] and given[1] and not set(given[0]) & set(given[1])
        assert len(given[0]) + len(given[1]) == len(prompts) + 1 + 2 + 2
    assert lead["compact_summary"]["replicas"] == 2 and lead["compact_summary"]["accept_length"] >= 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_over_two_hosts_answers_like_one_engine(model_dir, plain, tmp_path):
    """`serving.launch --nnodes 2 --dp-size 2`, one process per host on localhost: rank 0 serves
    and routes to both hosts' replicas; its completions are the single engine's, /server_info
    and /metrics report both replicas, a client that hangs up frees its replica, and SIGTERM ends
    both processes cleanly."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from concurrent.futures import ThreadPoolExecutor

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    root = Path(__file__).resolve().parents[1]
    http, coord = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    env.update(JAX_PLATFORMS="cpu")
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "serving.launch", "--model-path", str(model_dir), "--nnodes", "2",
                               "--node-rank", str(r), "--dist-init-addr", f"127.0.0.1:{coord}", "--dp-size", "2",
                               "--port", str(http), "--max-running-requests", "4", "--max-model-len", "256",
                               "--no-precompile", "--log-level", "warning"],
                              cwd=root, env=env, stdout=logs[r], stderr=subprocess.STDOUT) for r in (0, 1)]
    base = f"http://127.0.0.1:{http}"
    show = lambda: "\n=====\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))
    try:
        deadline = time.time() + 300
        while True:
            assert all(p.poll() is None for p in procs), show()
            try:
                if httpx.get(base + "/health", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "server did not become healthy\n" + show()
            time.sleep(0.2)
        info = httpx.get(base + "/server_info", trust_env=False).json()
        assert info["dp_size"] == 2 and [s["replica"] for s in info["internal_states"]] == [0, 1]

        def complete(prompt):
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            return httpx.post(base + "/v1/completions", json=body, timeout=120, trust_env=False).json()

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(complete, PROMPTS[:4]))
        want = plain.generate(PROMPTS[:4], SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert [a["choices"][0]["text"] for a in answers] == [w.text for w in want], show()
        states = httpx.get(base + "/server_info", trust_env=False).json()["internal_states"]
        routed = [s["routed_requests"] for s in states]
        assert sum(routed) == 4 and min(routed) >= 1  # both hosts served
        metrics = httpx.get(base + "/metrics", trust_env=False).text
        assert all(f'dspark:replica_kv_usage{{replica="{r}"}}' in metrics for r in (0, 1))
        body = {"prompt": PROMPTS[4], "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60, trust_env=False) as resp:
            next(line for line in resp.iter_lines() if line.startswith("data: {"))  # then hang up
        deadline = time.time() + 60
        while any(s["running"] or s["waiting"] for s in httpx.get(base + "/server_info", trust_env=False)
                  .json()["internal_states"]):  # the abort reaches its replica, wherever it is
            assert time.time() < deadline, show()
            time.sleep(0.2)
        metrics = httpx.get(base + "/metrics", trust_env=False).text
        assert 'dspark:requests_total{finish_reason="abort"} 1.0' in metrics
        assert complete(PROMPTS[0])["choices"][0]["text"] == want[0].text
        procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(timeout=120) for p in procs] == [0, 0], show()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
