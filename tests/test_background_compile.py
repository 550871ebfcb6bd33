"""Lazily compiled processed executables build in the background: while one compiles, the batch
goes on without the requests that need it, and those requests then commit exactly the tokens
and logprobs of an engine that compiled the same executables in its loop."""

from __future__ import annotations

import threading
import time

import pytest

from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.request import Status
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


@pytest.mark.parametrize("arm", ["plain", "compact", "mtp"])
def test_a_compiling_processed_executable_holds_up_only_its_requests(target, arm):  # noqa: F811
    want = _engine(target, arm, logit_processors="precompile").generate(PROMPTS, PARAMS)  # compiled in the loop
    eng = _engine(target, arm)
    gate, compile_fn = threading.Event(), eng.background._compile
    eng.background._compile = lambda lowered: gate.wait(60) and compile_fn(lowered)
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
    assert not eng.background.busy
    eng.pool.check_invariants()


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
