"""Lazily compiled processed executables build in the background: while one compiles, the batch
goes on without the requests that need it, and those requests then commit exactly the tokens
and logprobs of an engine that compiled the same executables in its loop."""

from __future__ import annotations

import threading
import time

import pytest

from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.request import Status
from dspark_jax.engine.startup import startup_executables
from dspark_jax.sampling import SamplingParams
from dspark_jax.spec.config import SpeculativeConfig
from tests.test_mtp_engine import repeat_drafter
from tests.test_speculative_engine import TABLE, repeat_biased_drafter
from tests.tiny_engines import EC, model_dir, target  # noqa: F401 - fixtures

PROMPTS = [[5, 17, 42, 9, 33], [8, 8, 120, 7]]
PARAMS = [SamplingParams(max_new_tokens=12, ignore_eos=True),
          SamplingParams(max_new_tokens=12, ignore_eos=True, presence_penalty=0.8, logprobs=2)]


def _engine(target, arm: str, **ec) -> Engine:  # noqa: F811
    config = EngineConfig(**{**EC, **ec})
    if arm == "plain":
        return Engine(target, None, config)
    if arm == "mtp":
        return Engine(target, None, config, drafter=repeat_drafter(target), spec=SpeculativeConfig(algorithm="mtp"))
    return Engine(target, None, config, drafter=repeat_biased_drafter(target),
                  spec=SpeculativeConfig(mode="compact", cost_table=TABLE))


def held(gate: threading.Event, compile_fn):
    """A background compile that waits for the gate.  A slow machine can take minutes to reach
    the point where a test opens it, so the wait is long, and one that runs out is an error (not
    a compile that returned nothing)."""
    def compile_when_open(lowered):
        if not gate.wait(600):
            raise TimeoutError("the test never opened the compile gate")
        return compile_fn(lowered)

    return compile_when_open


@pytest.mark.parametrize("arm", ["plain", "compact", "mtp"])
def test_a_compiling_processed_executable_holds_up_only_its_requests(target, arm):  # noqa: F811
    want = _engine(target, arm, logit_processors="precompile").generate(PROMPTS, PARAMS)  # compiled in the loop
    eng = _engine(target, arm)
    gate, compile_fn = threading.Event(), eng.background._compile
    eng.background._compile = held(gate, compile_fn)
    ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    plain, processed = (eng._requests[i] for i in ids)
    for _ in range(200):
        if plain.status is Status.FINISHED:
            break
        eng.step()
    # the plain request ran to its end while the processed one waited on its compile
    assert plain.status is Status.FINISHED and plain.output_ids == want[0].token_ids
    assert eng.background.busy and len(processed.output_ids) == 1  # its first token, from prefill
    gate.set()
    while processed.status is not Status.FINISHED:
        eng.step()
    eng.settle()
    got = processed.result()
    assert got.token_ids == want[1].token_ids
    assert got.logprobs == pytest.approx(want[1].logprobs, abs=1e-5)
    assert got.top_logprobs is not None and len(got.top_logprobs) == len(got.token_ids)
    _wait_idle(eng.background)
    eng.pool.check_invariants()


def _wait_idle(bg, timeout: float = 120) -> None:
    """Until every queued compile has finished (shapes a finished request asked for go on
    compiling after it, for the requests to come)."""
    deadline = time.time() + timeout
    while bg.busy and time.time() < deadline:
        time.sleep(0.05)
    assert not bg.busy


def test_a_failed_background_compile_reaches_the_loop(target):  # noqa: F811
    eng = _engine(target, "plain")

    def broken(lowered):
        raise RuntimeError("compiler gave up")

    eng.background._compile = broken
    eng.add_request(PROMPTS[1], PARAMS[1])
    with pytest.raises(RuntimeError, match="compiler gave up"):
        for _ in range(200):
            eng.step()


def test_closing_drops_queued_compiles():
    """At shutdown only the compile already running is waited for; queued ones never start."""
    from dspark_jax.engine.background_compile import BackgroundCompiles, ExecutablePending

    gate, started = threading.Event(), []
    bg = BackgroundCompiles(lambda lowered: started.append(lowered) or gate.wait(60))
    cache: dict = {}
    for key in ("a", "b", "c"):
        with pytest.raises(ExecutablePending):
            bg.get(cache, key, lambda key=key: key)
    futures = [f for _, _, f, _ in bg._pending.values()]
    while not started:  # the first compile is running before the shutdown
        time.sleep(0.01)
    bg.close()
    gate.set()
    futures[0].result(timeout=60)
    assert started == ["a"] and all(f.cancelled() for f in futures[1:]) and not bg.busy


def _widest(eng, arm: str):
    """key -> the widest shape of key's kind, as the worker names it."""
    if arm == "plain":
        return lambda key: eng.worker._widest(key[-1])
    if arm == "compact":
        return lambda key: eng.worker._widest_round(key[1], key[-1])
    return lambda key: eng.worker._widest_round(key[-1])


@pytest.mark.parametrize("arm", ["plain", "compact", "mtp"])
def test_processed_steps_run_padded_on_the_widest_shape_while_their_own_compiles(target, arm):  # noqa: F811
    """The widest processed step is asked for first; once it is compiled, a processed request
    no longer waits on the compile of its own shape (held here until the end): its steps run
    padded to the widest tokens, rows and pages, and commit the tokens and logprobs of an engine
    that compiled every shape in its loop."""
    want = _engine(target, arm, logit_processors="precompile", min_context_bucket=16).generate(PROMPTS, PARAMS)
    eng = _engine(target, arm, min_context_bucket=16)
    assert len(eng.page_widths) > 1  # narrower page tables exist, so the padding covers pages too
    largest = _widest(eng, arm)
    queued, bg = [], eng.background
    get, compile_fn, gate = bg.get, bg._compile, threading.Event()

    def recording_get(cache, key, lower):
        if key not in cache and (id(cache), key) not in bg._pending:
            queued.append(key)
        return get(cache, key, lower)

    def widest_only(lowered):  # the compile thread runs them in the order queued
        key = queued[len(compiled)]
        compiled.append(key)
        if key != largest(key) and not gate.wait(30):
            raise RuntimeError(f"{key} was waited for")
        return compile_fn(lowered)

    compiled: list = []
    bg.get, bg._compile = recording_get, widest_only
    got = eng.generate(PROMPTS, PARAMS)
    assert queued and queued[0] == largest(queued[0])
    held = [k for k in queued if k != largest(k)]
    assert held and bg.busy  # the processed request's own shapes are still compiling
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert got[1].logprobs == pytest.approx(want[1].logprobs, abs=1e-5)
    gate.set()
    _wait_idle(bg)
    eng.pool.check_invariants()


@pytest.mark.parametrize("arm", ["plain", "compact", "mtp"])
def test_warming_queues_every_widest_processed_step(target, arm):  # noqa: F811
    """What a server queues once it is up: the widest processed step of every kind the worker
    runs (the shapes any processed batch can run padded on), each compiled off the loop."""
    eng = _engine(target, arm)
    widest = eng.worker.widest(processed=True)
    assert widest and all(k[-3] == max(eng.decode_buckets) and k[-2] == max(eng.page_widths) for k in widest)
    assert [_widest(eng, arm)(k) for k in widest] == widest
    assert not any(k in eng.worker._compiled for k in widest)
    eng.worker.warm_processed()
    assert eng.background.busy
    _wait_idle(eng.background)
    eng.background._collect()
    assert all(k in eng.worker._compiled for k in widest)


def test_a_cover_is_the_narrowest_compiled_shape_at_least_as_wide():
    from dspark_jax.engine.background_compile import ExecutablePending, own_or_cover

    cache = {("round", "compact", 64, 8, 4, True): "a", ("round", "compact", 32, 8, 8, True): "b",
             ("round", "compact", 128, 16, 8, True): "c", ("round", "static", 16, 2, 2, True): "d",
             ("round", "compact", 16, 2, 2, False): "e", ("prefill", 64, 8, True): "f"}
    asked = []

    def get(key):
        asked.append(key)
        if key not in cache:
            raise ExecutablePending(key)
        return cache[key]

    own = ("round", "compact", 16, 2, 2, True)
    widest = ("round", "compact", 128, 16, 8, True)
    assert own_or_cover(cache, own, get, dims=(2, 3, 4), widest=widest) == (("round", "compact", 32, 8, 8, True), "b")
    assert asked == [widest, own]  # the widest first
    # pages 8 wanted: "a" (4 pages) no longer holds it, nor does anything of another mode or level
    assert own_or_cover(cache, own[:4] + (8, True), get, dims=(2, 3, 4), widest=None)[1] == "b"
    assert own_or_cover(cache, ("round", "compact", 16, 2, 2, False), get, dims=(2, 3, 4), widest=None)[1] == "e"
    # tokens and rows fixed (a fed step): only shapes with exactly those qualify
    with pytest.raises(ExecutablePending):
        own_or_cover(cache, ("round", "compact", 16, 2, 2, True), get, dims=(4,), widest=None)
    with pytest.raises(ExecutablePending):
        own_or_cover(cache, ("round", "compact", 256, 16, 8, True), get, dims=(2, 3, 4), widest=None)
    assert own_or_cover(cache, ("round", "compact", 32, 8, 8, True), get, dims=(2, 3, 4), widest=None)[1] == "b"


@pytest.mark.parametrize("arm", ["plain", "compact", "mtp"])
def test_without_background_compiles_only_the_shapes_run_are_built(target, arm):  # noqa: F811
    """Where processed steps compile in the loop (precompiled processors) nothing pads, so a
    lone processed request builds its own shape and not the widest."""
    eng = _engine(target, arm, logit_processors="precompile")
    assert eng.background is None
    eng.generate(PROMPTS[1:], PARAMS[1:])
    widest = eng.worker.widest(processed=True)
    assert not any(k in eng.worker._compiled for k in widest)


@pytest.mark.parametrize("arm", ["plain", "compact", "mtp"])
def test_a_widest_first_start_up_serves_on_the_widest_while_the_rest_compile(target, arm):  # noqa: F811
    """A widest-first start-up compiles only the widest prefill and step of every kind, then
    serves: with every other compile held, prefills and steps of any batch run padded on those
    and commit the tokens of an engine that compiled each shape in its loop (greedy and
    sampled); once the queued compiles finish, every executable is there and steps use their own."""
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=3)]
    want = _engine(target, arm, min_context_bucket=16, widest_first=False).generate(PROMPTS, params)
    eng = _engine(target, arm, min_context_bucket=16, widest_first=True)
    bg, gate = eng.background, threading.Event()
    compile_fn = bg._compile
    bg._compile = held(gate, compile_fn)
    eng.prepare()
    widest = eng.worker.widest(processed=False)
    assert set(eng.worker._compiled) == set(widest) and bg.busy  # the rest queued, none built
    # the widest processed steps head the queue, so a processed request waits for them alone;
    # then the narrowest, whose batches the widest holds with the most padding
    processed = eng.worker.widest(processed=True)
    queued = [key for _, key in bg._pending]
    assert queued[:len(processed)] == processed
    assert queued[len(processed):] == [k for k in eng.worker.keys()[::-1] if k not in widest]
    got = eng.generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert set(eng.worker._compiled) == set(widest)  # nothing compiled in the loop
    gate.set()
    _wait_idle(bg)
    bg._collect()
    assert set(eng.worker._compiled) == set(eng.worker.keys()) | set(processed)
    assert len(eng.worker.keys()) > len(widest)
    again = eng.generate(PROMPTS, params)
    assert [g.token_ids for g in again] == [w.token_ids for w in want]
    eng.pool.check_invariants()


def test_a_start_up_that_profiles_compiles_what_the_profile_runs_first(target):  # noqa: F811
    """A cost table still to be derived profiles every tier on its own executable with greedy
    requests, so a widest-first start-up compiles all of those before serving, and queues only
    the narrower executables that sampled batches alone run; a table given up front leaves
    everything but the widest for later."""
    def startup(table):
        eng = Engine(target, None, EngineConfig(**{**EC, "widest_first": True}), drafter=repeat_biased_drafter(target),
                     spec=SpeculativeConfig(mode="compact", cost_table=table))
        return eng, startup_executables(eng)

    eng, (now, later) = startup("derive")
    keys, widest = eng.worker.keys(), eng.worker.widest(processed=False)
    # the start-up's compile pool starts the costliest first: the widest round, prefill (scanned) last
    assert keys[0] == widest[1] and keys[0][1] == "compact" and keys[-1][0] == "prefill"
    sampled = [k for k in keys if k[:2] == ("round", "decode")]
    assert later == [] and len(sampled) > 1
    assert {label for label, _ in now} == {eng.worker.describe(k) for k in keys if k in widest or k not in sampled} | {
        label for label, _ in eng.processors.executables()}
    _, (now, later) = startup(TABLE)
    assert len(now) < len(later)


def test_a_profiling_start_up_queues_the_rest_once_the_table_is_derived(target, tmp_path, monkeypatch):  # noqa: F811
    """The profile runs on what the start-up compiled (nothing compiles in its loop, nothing is
    queued while it times); then the sampled-only executables queue, and sampled requests run
    padded on the widest until theirs are ready, committing an eagerly compiled engine's tokens."""
    from dspark_jax.spec.dspark import profile, worker

    monkeypatch.setattr(profile, "derive_cost_table", lambda w, cache_dir=None, measure=True, real=profile.derive_cost_table:
                        real(w, tmp_path, measure))
    monkeypatch.setattr(worker.DSparkWorker, "speculation_pays", lambda self: True)  # keep the drafter either way
    config = EngineConfig(**{**EC, "widest_first": True, "precompile": False})
    eng = Engine(target, None, config, drafter=repeat_biased_drafter(target),
                 spec=SpeculativeConfig(mode="compact", cost_table="derive"))
    bg, gate, compile_fn = eng.background, threading.Event(), eng.background._compile
    bg._compile = held(gate, compile_fn)
    first = {k for k in eng.worker.keys() if not eng.worker.sampled_only(k)} | set(eng.worker.widest(processed=False))
    eng.prepare()
    assert not eng.worker.needs_calibration and eng.worker.scheduler.cost_table is not None
    assert set(eng.worker._compiled) == first  # the profile compiled nothing more in its loop
    queued = {key for _, key in bg._pending}
    assert queued and all(eng.worker.sampled_only(k) for k in queued if k not in eng.worker.widest(processed=True))
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=5),
              SamplingParams(max_new_tokens=7, ignore_eos=True)]
    eager = Engine(target, None, EngineConfig(**{**EC, "widest_first": False}), drafter=repeat_biased_drafter(target),
                   spec=SpeculativeConfig(mode="compact", cost_table=eng.worker.scheduler.cost_table))
    want = eager.generate(PROMPTS, params)
    got = eng.generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert set(eng.worker._compiled) == first
    gate.set()
    _wait_idle(bg)


def test_a_profile_waits_for_the_queued_compiles(target):  # noqa: F811
    """A cost profile times each tier on its own executable, never padded onto a wider one: it
    first lets every compile a widest-first start-up queued finish."""
    from dspark_jax.spec.dspark.profile import profile_cells

    eng = _engine(target, "compact", widest_first=True)
    eng.prepare()
    assert eng.background.busy or len(eng.worker._compiled) == len(eng.worker.executables())
    cells = profile_cells(eng, [1], fractions=(0.5,), context=16, warmup=1, iters=2)
    assert not eng.background.busy and len(eng.worker._compiled) >= len(eng.worker.executables())
    round_cell = next(c for c in cells if c["K"] is not None)
    assert round_cell["tier"] == eng.worker.tiers.tier_for(1, round_cell["K"]) < eng.worker.tiers.max_tier
