"""Tensor parallelism: a TP 2 / TP 4 engine commits the single-device tokens (plain, DSpark static /
compact / cap-accept, MTP; greedy in fp32 and seeded sampling), holds every parameter, cache and
result in its designed sharding, compiles nothing after start-up, and refuses what cannot split.

Needs 4 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4, read when JAX starts):
in a process started without them, one test runs this module in a subprocess that has them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.parallel.sharding import TP_AXIS, HeadLayout
from dspark_jax.sampling import SamplingParams
from dspark_jax.spec.config import SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 4
FLAG = f"--xla_force_host_platform_device_count={DEVICES}"
ENOUGH = jax.device_count() >= DEVICES
needs_devices = pytest.mark.skipif(not ENOUGH, reason="run in a subprocess with 4 host devices "
                                                      "(test_parallel_module_in_subprocess)")

V = 298  # not a multiple of 4: TP 4 pads the vocabulary
EC = dict(max_running_requests=4, max_prefill_tokens=32, max_model_len=128, page_size=8, precompile=False,
          min_context_bucket=0)
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SEEDED = [SamplingParams(max_new_tokens=8, temperature=0.9, seed=21 + i, ignore_eos=True) for i in range(2)]


# The module's device tests in groups of about equal cost, each run by its own subprocess, so
# that a parallel test run spreads them over its workers instead of running them in one process.
GROUPS = {
    "engines": ["test_plain_greedy_and_shardings", "test_untied_head_and_split_kv_heads",
                "test_seeded_sampling_matches_single_device", "test_bad_parallel_configs_fail_at_construction",
                "test_checkpoint_loads_straight_into_shards", "test_server_tp2_dp2_answers_like_the_single_device_server"],
    "dspark": ["test_dspark_commits_single_device_tokens", "test_dspark_seeded_sampling_matches_single_device",
               "test_nothing_compiles_after_start_up", "test_cost_table_key_names_the_parallel_configuration"],
    "processors-mtp": ["test_logit_processors_and_logprobs_match_single_device", "test_mtp_commits_single_device_tokens"],
    "processes": ["test_tp2_engine_across_two_processes_commits_the_single_process_tokens"],
    "replicas": ["test_tp2_dp2_replicas_commit_single_device_tokens_in_every_arm"],
}


@pytest.mark.slow
@pytest.mark.skipif(ENOUGH, reason="this process has the devices: the tests run here")
@pytest.mark.parametrize("group", list(GROUPS))
def test_parallel_module_in_subprocess(group):
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip(), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    tests = [f"{__file__}::{name}" for name in GROUPS[group]]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "failed" not in summary and "error" not in summary, summary
    assert "skipped" not in summary, summary  # every test of the group ran


def test_groups_hold_every_device_test_once():
    """Each test that needs the devices is in exactly one subprocess group (a new one must be added)."""
    grouped = [name for names in GROUPS.values() for name in names]
    device_tests = [name for name, fn in globals().items() if name.startswith("test_") and any(
        m.name == "skipif" and "test_parallel_module_in_subprocess" in m.kwargs.get("reason", "")
        for m in getattr(fn, "pytestmark", []))]
    assert sorted(grouped) == sorted(device_tests) and len(set(grouped)) == len(grouped)


# -- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target():
    from tests.test_mtp_engine import scaled_target

    # Hq 4, Hkv 2 (TP 4 replicates each KV head twice), tied head, q/k/v/o biases.
    return scaled_target(vocab=V, attention_bias=True)


@pytest.fixture(scope="module")
def untied():
    from tests.test_mtp_engine import scaled_target

    return scaled_target(vocab=V, seed=3, tie_word_embeddings=False, num_key_value_heads=4)


def _prompts(n=5, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, V, size=int(rng.integers(1, 24))).tolist() for _ in range(n)]


_REF: dict = {}


def reference(model, key, prompts, params):
    """Single-device tokens (cached per model and request set)."""
    k = (id(model), key)
    if k not in _REF:
        _REF[k] = [r.token_ids for r in Engine(model, None, EngineConfig(**EC)).generate(prompts, params)]
    return _REF[k]


def spec_of(array) -> P:
    s = array.sharding
    return s.spec if hasattr(s, "spec") else None


def same_spec(a: P, b: P) -> bool:
    """PartitionSpecs equal up to trailing Nones."""
    strip = lambda p: tuple(p) + (None,) * (8 - len(tuple(p)))
    return strip(a) == strip(b)


# -- layout --------------------------------------------------------------------------------------

def test_fused_qkv_layout_keeps_each_shards_gqa_group():
    """Hq 8, Hkv 2, D 1: at TP 4 shard s holds q heads 2s, 2s+1 and kv head s // 2 (replicated);
    at TP 2, q heads 4s..4s+3 and kv head s."""
    lay = HeadLayout(tp=4, num_heads=8, num_kv_heads=2, head_dim=1, intermediate=8, vocab=10)
    lay.validate()
    cols = lay.param_rule(("layers", "self_attn", "qkv_proj", "kernel"), 3).columns.reshape(4, -1)
    q, k, v = 0, 8, 10  # column offsets of the q, k and v heads
    assert cols.tolist() == [[q + 2 * s, q + 2 * s + 1, k + s // 2, v + s // 2] for s in range(4)]
    assert lay.cache_heads == 4 and lay.padded_vocab == 12
    lay2 = HeadLayout(tp=2, num_heads=8, num_kv_heads=2, head_dim=1, intermediate=8, vocab=10)
    cols = lay2.param_rule(("self_attn", "qkv_proj", "kernel"), 2).columns.reshape(2, -1)
    assert cols.tolist() == [[*range(4 * s, 4 * s + 4), k + s, v + s] for s in range(2)]
    gate_up = lay2.param_rule(("mlp", "gate_up_proj", "kernel"), 2).columns.reshape(2, -1)
    assert gate_up.tolist() == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_layout_blocks_read_without_the_whole_array():
    """ParamRule.block (what a checkpoint loader reads per shard) equals the block of the whole
    layout, for fused columns, padded vocabulary rows and row splits."""
    lay = HeadLayout(tp=4, num_heads=8, num_kv_heads=2, head_dim=3, intermediate=8, vocab=10)
    rng = np.random.default_rng(0)
    for path, shape in ((("qkv_proj", "kernel"), (2, 5, 36)), (("embed_tokens", "embedding"), (10, 5)),
                        (("lm_head", "kernel"), (5, 10)), (("o_proj", "kernel"), (2, 24, 5)),
                        (("norm", "weight"), (5,))):
        rule = lay.param_rule(path, len(shape))
        a = rng.normal(size=shape).astype(np.float32)
        whole = rule.layout(a)
        ax = None if rule.axis is None else rule.axis % len(shape)
        for s in range(4):
            idx = [slice(None)] * len(shape)
            if ax is not None:
                n = whole.shape[ax] // 4
                idx[ax] = slice(s * n, (s + 1) * n)
            np.testing.assert_array_equal(rule.block(a, tuple(idx)), whole[tuple(idx)])


# -- engines -------------------------------------------------------------------------------------

@needs_devices
@pytest.mark.parametrize("tp", [2, 4])
def test_plain_greedy_and_shardings(target, tp):
    prompts = _prompts()
    eng = Engine(target, None, EngineConfig(**EC, tp_size=tp))
    got = [r.token_ids for r in eng.generate(prompts, GREEDY)]
    assert got == reference(target, "greedy", prompts, GREEDY)
    # Parameters: every leaf in its designed spec, over this engine's devices.
    par = eng.parallel
    assert par.devices == jax.devices()[:tp]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(eng.runner.state_def, eng.runner.state))[0]]
    want = {"qkv_proj']['kernel": P(None, None, TP_AXIS), "qkv_proj']['bias": P(None, TP_AXIS),
            "o_proj']['kernel": P(None, TP_AXIS, None), "o_proj']['bias": P(),
            "gate_up_proj']['kernel": P(None, None, TP_AXIS), "down_proj']['kernel": P(None, TP_AXIS, None),
            "embed_tokens']['embedding": P(TP_AXIS, None), "norm']['weight": P()}
    seen = set()
    for path, leaf in zip(paths, eng.runner.state):
        assert leaf.sharding.mesh.devices.tolist() == par.devices
        for key, spec in want.items():
            if key in path:
                seen.add(key)
                assert same_spec(spec_of(leaf), spec), (path, leaf.sharding)
        if "norm" in path:
            assert spec_of(leaf) == P()
    assert seen == set(want)
    # Heads per shard: the cache holds max(Hkv, tp) heads, tp-way split.
    k = eng.runner.cache.k
    assert same_spec(spec_of(k), P(None, None, None, TP_AXIS)) and k.shape[3] == max(2, tp)
    assert {s.data.shape[3] for s in k.addressable_shards} == {max(2, tp) // tp}
    assert eng.runner.state[paths.index(next(p for p in paths if "embed_tokens" in p))].shape[0] == -(-V // tp) * tp
    # A step's results: replicated tokens, the cache in its spec.
    req = eng.add_request(prompts[0], GREEDY)
    eng.step()  # the prefill
    eng.step()  # a decode step, left in flight
    step = eng._inflight
    assert step is not None and spec_of(step.tokens) == P()
    assert same_spec(spec_of(eng.runner.cache.k), P(None, None, None, TP_AXIS))
    eng.abort(req)


@needs_devices
def test_untied_head_and_split_kv_heads(untied):
    """An untied LM head (vocab-parallel columns) and as many KV heads as query heads."""
    prompts = _prompts(4, seed=1)
    eng = Engine(untied, None, EngineConfig(**EC, tp_size=4))
    assert [r.token_ids for r in eng.generate(prompts, GREEDY)] == reference(untied, "greedy", prompts, GREEDY)
    assert eng.runner.cache.k.shape[3] == 4


@needs_devices
def test_seeded_sampling_matches_single_device(target):
    prompts = _prompts(4, seed=2)
    params = [SamplingParams(max_new_tokens=10, temperature=0.8, top_k=40, top_p=0.95, seed=11 + i, ignore_eos=True)
              for i in range(4)]
    eng = Engine(target, None, EngineConfig(**EC, tp_size=2))
    assert [r.token_ids for r in eng.generate(prompts, params)] == reference(target, "seeded", prompts, params)


@pytest.fixture(scope="module")
def dspark_drafter(target):
    from tests.test_speculative_engine import repeat_biased_drafter

    return repeat_biased_drafter(target)


@needs_devices
@pytest.mark.parametrize("tp, mode", [(2, "static"), (2, "compact"), (2, "cap-accept"), (4, "compact")])
def test_dspark_commits_single_device_tokens(target, dspark_drafter, tp, mode):
    from tests.test_speculative_engine import TABLE

    prompts = _prompts()
    eng = Engine(target, None, EngineConfig(**EC, tp_size=tp), drafter=dspark_drafter,
                 spec=SpeculativeConfig(mode=mode, cost_table=None if mode == "static" else TABLE))
    got = [r.token_ids for r in eng.generate(prompts, GREEDY)]
    assert got == reference(target, "greedy", prompts, GREEDY)
    assert eng.summary()["accept_length"] > 1.0  # drafts were accepted, not only bonus tokens
    w = eng.worker
    assert same_spec(spec_of(w.dcache.k), P(None, None, None, TP_AXIS))
    assert spec_of(w.sts_temperatures) == P() and spec_of(w._no_feed[0]) == P()
    # A round's results: the packed host results and the fed anchors replicated, caches by heads.
    req = eng.add_request(prompts[0], GREEDY)
    eng.step()
    eng.step()
    call = eng._inflight
    assert spec_of(call.results) == P() and spec_of(call.next_anchor) == P() and spec_of(call.next_start) == P()
    assert same_spec(spec_of(eng.runner.cache.v), P(None, None, None, TP_AXIS))
    eng.abort(req)
    specs = dict(zip([jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(w.state_defs[1], w.drafter_state))[0]], [spec_of(x) for x in w.drafter_state]))
    for key, spec in (("q_proj']['kernel", P(None, None, TP_AXIS)), ("kv_proj']['kernel", P(None, None, TP_AXIS)),
                      ("layers']['o_proj']['kernel", P(None, TP_AXIS, None)), ("w1']['embedding", P(TP_AXIS, None)),
                      ("w2']['kernel", P(None, TP_AXIS)), ("confidence']['kernel", P()), ("['fc']['kernel", P())):
        hits = [s for k, s in specs.items() if key in k]
        assert hits and all(same_spec(s, spec) for s in hits), (key, hits)


@needs_devices
def test_dspark_seeded_sampling_matches_single_device(target, dspark_drafter):
    prompts = _prompts(3, seed=4)
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=5 + i, ignore_eos=True) for i in range(3)]
    spec = dict(drafter=dspark_drafter, spec=SpeculativeConfig(mode="static"))
    want = [r.token_ids for r in Engine(target, None, EngineConfig(**EC), **spec).generate(prompts, params)]
    got = Engine(target, None, EngineConfig(**EC, tp_size=2), **spec).generate(prompts, params)
    assert [r.token_ids for r in got] == want


@needs_devices
@pytest.mark.parametrize("tp", [2, 4])
def test_logit_processors_and_logprobs_match_single_device(target, dspark_drafter, tp):
    """Penalties, logit bias, min_tokens and logprobs under tensor parallelism (state replicated,
    as the gathered logits are; TP 4 pads the vocabulary): plain and DSpark static commit the
    single-device tokens, greedy and seeded, with the same logprobs."""
    prompts = _prompts(4, seed=6)
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True, repetition_penalty=1.4, frequency_penalty=0.6,
                             presence_penalty=0.3, logit_bias={5: 4.0, 11: -100.0}, min_tokens=3, logprobs=2,
                             stop_token_ids=(17,), temperature=0.8 * (i % 2), seed=40 + i) for i in range(4)]
    for spec in ({}, dict(drafter=dspark_drafter, spec=SpeculativeConfig(mode="static"))):
        key = (id(target), "processors", bool(spec))  # the single-device results, shared by both tp
        if key not in _REF:
            _REF[key] = Engine(target, None, EngineConfig(**EC), **spec).generate(prompts, params)
        want = _REF[key]
        eng = Engine(target, None, EngineConfig(**EC, tp_size=tp), **spec)
        got = eng.generate(prompts, params)
        assert spec_of(eng.processors.state.counts) == P() and eng.processors.state.counts.shape[1] % tp == 0
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-4, atol=1e-4)
            assert [[t for t, _ in row] for row in g.top_logprobs] == [[t for t, _ in row] for row in w.top_logprobs]


@needs_devices
@pytest.mark.parametrize("tp", [2, 4])
def test_mtp_commits_single_device_tokens(target, tp):
    from tests.test_mtp_engine import repeat_drafter

    prompts = _prompts(4, seed=3)
    eng = Engine(target, None, EngineConfig(**EC, tp_size=tp), drafter=repeat_drafter(target),
                 spec=SpeculativeConfig(algorithm="mtp", num_steps=3))
    assert [r.token_ids for r in eng.generate(prompts, GREEDY)] == reference(target, "greedy3", prompts, GREEDY)
    assert eng.summary()["accept_length"] > 1.0
    assert same_spec(spec_of(eng.worker.dcache.k), P(None, None, None, TP_AXIS))
    assert spec_of(eng.worker.pending.hidden) == P()


@needs_devices
def test_nothing_compiles_after_start_up(target, dspark_drafter):
    """Every executable is compiled at start-up: generating (prefill, greedy and sampled decode,
    DSpark rounds) compiles nothing, neither in the runner's record nor anywhere in JAX."""
    from jax import monitoring

    ec = EngineConfig(**{**EC, "precompile": True, "max_running_requests": 2, "max_prefill_tokens": 16}, tp_size=2)
    engines = [Engine(target, None, ec),
               Engine(target, None, ec, drafter=dspark_drafter, spec=SpeculativeConfig(mode="static"))]
    events = []
    listener = lambda name, *_a, **_k: events.append(name) if "compile" in name and "cache" not in name else None
    monitoring.register_event_duration_secs_listener(listener)
    try:
        for eng in engines:
            eng.runner.take_compile_spans()
            eng.generate(_prompts(3, seed=6), [GREEDY, SamplingParams(max_new_tokens=6, temperature=1.0, seed=1),
                                               GREEDY])
            assert eng.runner.take_compile_spans() == []
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert events == []


@needs_devices
def test_cost_table_key_names_the_parallel_configuration(target, dspark_drafter):
    from dspark_jax.spec.dspark.profile import _cache_key

    keys = {tp: _cache_key(Engine(target, None, EngineConfig(**EC, tp_size=tp), drafter=dspark_drafter,
                                  spec=SpeculativeConfig(mode="static")).worker, 64) for tp in (1, 2)}
    assert keys[1] != keys[2]


# -- bad input -----------------------------------------------------------------------------------

@needs_devices
def test_bad_parallel_configs_fail_at_construction():
    from tests.test_mtp_engine import scaled_target

    small = scaled_target(vocab=64, num_attention_heads=6, num_key_value_heads=3, head_dim=8, intermediate_size=130)
    with pytest.raises(ValueError, match="does not divide the target's 6 query heads"):
        Engine(small, None, EngineConfig(**EC, tp_size=4))
    with pytest.raises(ValueError, match="3 KV heads: one must divide"):
        Engine(small, None, EngineConfig(**EC, tp_size=2))
    mlp = scaled_target(vocab=64, intermediate_size=130)
    with pytest.raises(ValueError, match="does not divide the target's intermediate size 130"):
        Engine(mlp, None, EngineConfig(**EC, tp_size=4))
    with pytest.raises(ValueError, match=f"tp_size 8 needs 8 devices but only {jax.device_count()}"):
        Engine(mlp, None, EngineConfig(**EC, tp_size=8))
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        Engine(mlp, None, EngineConfig(**EC, tp_size=0))
    with pytest.raises(ValueError, match="needs exactly 2 devices, 1 given"):
        Engine(mlp, None, EngineConfig(**EC, tp_size=2), devices=jax.devices()[:1])


# -- data parallelism behind the server -----------------------------------------------------------

@needs_devices
def test_server_tp2_dp2_answers_like_the_single_device_server(tmp_path_factory):
    """Two TP 2 replicas behind one server: greedy answers (openai client, concurrent) equal the
    single-device server's, requests spread over both replicas, and /server_info and /metrics
    report each replica."""
    import asyncio

    import httpx
    openai = pytest.importorskip("openai")
    from prometheus_client.parser import text_string_to_metric_families

    from dspark_jax.server_args import ServerArgs
    from serving.app import ServerConfig, create_app
    from tests.conftest import write_hf_qwen3
    from tests.test_server import serve_in_thread

    folder = write_hf_qwen3(tmp_path_factory.mktemp("dp") / "m", max_pos=512)
    common = dict(model_path=str(folder), speculative_algorithm="NONE", max_running_requests=4, max_model_len=256,
                  max_prefill_tokens=64, precompile=False)
    prompts = ["def f(x):", "import numpy", "class A:", "for i in range(", "return self.", "x = [1, 2"]

    def answers(engines) -> tuple[list[str], dict, str]:
        app = create_app(engines, ServerConfig(model_name="m", model_path=str(folder)))
        with serve_in_thread(app) as base:
            async def run_all():
                async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300) as c:
                    async def one(p):
                        r = await c.completions.create(model="m", prompt=p, max_tokens=10, temperature=0,
                                                       extra_body={"ignore_eos": True})
                        return r.choices[0].text
                    return await asyncio.gather(*[one(p) for p in prompts])

            texts = asyncio.run(run_all())
            info = httpx.get(base + "/server_info", timeout=30, trust_env=False).json()
            metrics = httpx.get(base + "/metrics", timeout=30, trust_env=False).text
        return texts, info, metrics

    want, _, _ = answers(ServerArgs(**common).resolve().build_engines()[0])
    engines = ServerArgs(**common, tp_size=2, dp_size=2).resolve().build_engines()
    assert [e.parallel.devices for e in engines] == [jax.devices()[:2], jax.devices()[2:4]]
    got, info, metrics = answers(engines)
    assert got == want
    assert (info["tp_size"], info["dp_size"], len(info["internal_states"])) == (2, 2, 2)
    states = info["internal_states"]
    assert [s["replica"] for s in states] == [0, 1] and all(s["tp_size"] == 2 for s in states)
    assert all(s["total_steps"] > 0 for s in states)  # both replicas served requests
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(metrics) for s in fam.samples}
    assert {("dspark:replica_kv_usage", (("replica", "0"),)), ("dspark:replica_kv_usage", (("replica", "1"),))} \
        <= set(samples)
    assert samples[("dspark:requests_total", (("finish_reason", "length"),))] == len(prompts)


@needs_devices
def test_tp2_dp2_replicas_commit_single_device_tokens_in_every_arm(target, dspark_drafter):
    """Two TP 2 replicas behind the server's router (its engine threads, no HTTP): plain, DSpark
    static / compact / cap-accept and MTP commit the single-device engine's tokens, greedy and
    seeded, and both replicas serve."""
    import asyncio

    from dspark_jax.parallel.mesh import replica_device_groups
    from serving.replicas import ReplicaRouter
    from tests.test_mtp_engine import repeat_drafter
    from tests.test_speculative_engine import TABLE

    prompts = _prompts(6, seed=9)
    params = [GREEDY] * 4 + SEEDED
    arms = {"plain": {}, "mtp": dict(drafter=repeat_drafter(target), spec=SpeculativeConfig(algorithm="mtp", num_steps=3))}
    arms.update({mode: dict(drafter=dspark_drafter, spec=SpeculativeConfig(mode=mode, cost_table=TABLE if mode != "static"
                                                                            else None))
                 for mode in ("static", "compact", "cap-accept")})

    async def serve(router):
        loop = asyncio.get_running_loop()
        streams = [router.submit(p, sp, loop) for p, sp in zip(prompts, params)]
        done = {}
        for s in streams:
            while s.id not in done:
                _, event = await s.queue.get()
                if event[0] == "error":
                    raise event[1]
                if event[0] == "done":
                    done[s.id] = event[1].token_ids
        return [done[s.id] for s in streams], {router.replica_of(s.id) for s in streams}

    for name, kw in arms.items():
        want = [r.token_ids for r in Engine(target, None, EngineConfig(**EC), **kw).generate(prompts, params)]
        engines = [Engine(target, None, EngineConfig(**EC, tp_size=2), devices=g, **kw)
                   for g in replica_device_groups(2, 2)]
        router = ReplicaRouter(engines)
        router.start()
        try:
            got, used = asyncio.run(serve(router))
        finally:
            router.stop()
        assert got == want, name
        assert used == {0, 1}, name


def test_router_picks_the_least_loaded_replica():
    from serving.replicas import ReplicaRouter, combine_snapshots

    class FakeLoop:
        def __init__(self, active):
            import queue

            self.snapshot, self._commands, self.alive = {"active_streams": active}, queue.Queue(), True

    router = ReplicaRouter.__new__(ReplicaRouter)
    import itertools

    router._rr, router.loops = itertools.count(), [FakeLoop(3), FakeLoop(1), FakeLoop(1)]
    assert router.pick() in (1, 2)
    router.loops[1]._commands.put(("add",))  # submitted, not yet picked up: counts as load
    assert router.pick() == 2
    router.loops[2].alive = False
    assert router.pick() == 1
    snap = combine_snapshots([{"kv_used_pages": 1, "kv_total_pages": 4}, {"kv_used_pages": 3, "kv_total_pages": 4}])
    assert snap["kv_usage"] == 0.5 and snap["kv_used_pages"] == 4


# -- loading straight into shards ------------------------------------------------------------------

@needs_devices
@pytest.mark.parametrize("tp, kw", [(2, dict(tie=False, bias=True, shard=True)), (4, dict(tie=True))])
def test_checkpoint_loads_straight_into_shards(tmp_path_factory, tp, kw):
    """Engine.from_pretrained at tp > 1 reads each device's blocks from the safetensors files: the
    same leaves, bit for bit, as laying out the fully loaded model, and the single-device tokens."""
    from dspark_jax.checkpoint import load_model
    from dspark_jax.parallel.loading import ShardedModel, load_sharded
    from dspark_jax.parallel.runtime import Parallel
    from tests.conftest import write_hf_qwen3

    folder = write_hf_qwen3(tmp_path_factory.mktemp("ld") / "m", **kw)
    par = Parallel(tp)
    _, sharded = load_sharded(folder, par)
    assert isinstance(sharded, ShardedModel)
    _, full = load_model(folder)
    _, leaves, _ = Parallel(tp).split_module(full, "target")
    assert len(leaves) == len(sharded.leaves)
    for a, b in zip(sharded.leaves, leaves):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim) and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ec = EngineConfig(**{**EC, "max_model_len": 128})
    eng = Engine.from_pretrained(folder, ec, tp_size=tp)
    prompts = _prompts(3, seed=8)
    want = [r.token_ids for r in Engine.from_pretrained(folder, ec).generate(prompts, GREEDY)]
    assert [r.token_ids for r in eng.generate(prompts, GREEDY)] == want


# -- several processes -----------------------------------------------------------------------------

@needs_devices  # (where this process lacks them, the module's subprocess runs it)
def test_tp2_engine_across_two_processes_commits_the_single_process_tokens(tmp_path, target, dspark_drafter):
    """Two processes on localhost (gloo CPU collectives), one CPU device each, one TP 2 engine over
    both: run the same calls (SPMD), then rank 0 leading (LeaderEngine) while rank 1 replays its
    requests (follow), plain and DSpark static, greedy and seeded: rank 0 commits the tokens of a
    single-process, single-device engine."""
    from tests.multihost_worker import run_two_ranks

    out = tmp_path / "rank0.json"
    run_two_ranks(out)
    got = __import__("json").loads(out.read_text())
    prompts = _prompts()
    greedy = reference(target, "greedy", prompts, GREEDY)
    assert got["spmd"] == greedy and got["plain"] == greedy and got["dspark"] == greedy
    seeded = reference(target, "seeded2", prompts[:2], SEEDED)
    assert got["plain_seeded"] == seeded
    spec = dict(drafter=dspark_drafter, spec=SpeculativeConfig(mode="static"))
    want = [r.token_ids for r in Engine(target, None, EngineConfig(**EC), **spec).generate(prompts[:2], SEEDED)]
    assert got["dspark_seeded"] == want


def test_hosts_profile_the_cost_table_together_and_schedule_by_rank_0s(tmp_path, target):
    """A derived table over two processes: both profile in step (the profile's rounds are
    collective), and each takes rank 0's fit, which timings measured apart would never give;
    where only rank 0 has the table cached, rank 1 takes it too instead of profiling alone (which
    would leave it waiting in a collective).  The compact rounds rank 0 then leads commit the
    single-device greedy tokens."""
    from tests.multihost_worker import run_two_ranks

    out = tmp_path / "table"
    run_two_ranks(out, "derive-table")
    got = [__import__("json").loads((tmp_path / f"table.{r}").read_text()) for r in (0, 1)]
    assert got[0]["profiled"] == got[1]["profiled"] == got[0]["cached"] == got[1]["cached"]
    assert got[0]["tokens"] == reference(target, "greedy", _prompts(), GREEDY)


def test_parallel_flags_are_checked_and_reach_the_engine_config():
    from dspark_jax.server_args import ServerArgs

    ec = ServerArgs(tp_size=2, dp_size=3, speculative_algorithm="NONE").resolve().engine_config()
    assert (ec.tp_size, ec.dp_size) == (2, 3)
    for kw, msg in ((dict(nnodes=2), "needs --dist-init-addr"), (dict(tp_size=0), "--tp-size must be >= 1"),
                    (dict(nnodes=2, dist_init_addr="h:1", dp_size=3), "multiple of --nnodes"),
                    (dict(nnodes=2, node_rank=2, dist_init_addr="h:1"), "--node-rank must be in")):
        with pytest.raises(ValueError, match=msg):
            ServerArgs(**{"speculative_algorithm": "NONE", **kw}).resolve()
    with pytest.raises(ValueError, match="dp_size must be an integer"):
        EngineConfig(dp_size=0).validate()
