"""Engine behaviour: continuous batching, sampling controls, stop conditions, bad input."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.errors import InvalidRequestError
from dspark_jax.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def _prompts(engine, n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, engine.config.vocab_size, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


def test_continuous_batching_equals_isolated_runs(tiny_engine):
    prompts = _prompts(tiny_engine, 7)
    batched = tiny_engine.generate(prompts, GREEDY)  # 7 requests through 4 slots
    for p, r in zip(prompts, batched):
        alone = tiny_engine.generate([p], GREEDY)[0]
        assert r.token_ids == alone.token_ids
        assert len(r.token_ids) == 12 and r.finish_reason == "length"
    tiny_engine.pool.check_invariants()
    assert tiny_engine.pool.num_free_pages == tiny_engine.pool.num_usable_pages


def test_max_running_limit_holds_the_batch_and_changes_no_token(tiny_engine):
    """set_max_running(2) on an engine built for 4: never more than 2 running (and 2 at some
    point), the same greedy tokens as the full engine; out-of-range limits are refused."""
    prompts = _prompts(tiny_engine, 5, seed=7)
    want = [r.token_ids for r in tiny_engine.generate(prompts, GREEDY)]
    tiny_engine.set_max_running(2)
    try:
        ids = [tiny_engine.add_request(p, GREEDY) for p in prompts]
        done, most = {}, 0
        while tiny_engine.has_unfinished():
            tiny_engine.scheduler.admit()  # what step() does first: the batch it is about to run
            most = max(most, len(tiny_engine.scheduler.running))
            for req, _ in tiny_engine.step():
                if req.finish_reason is not None:
                    done[req.id] = list(req.output_ids)
        assert most == 2
        assert [done[i] for i in ids] == want
        with pytest.raises(ValueError, match="max running"):
            tiny_engine.set_max_running(0)
        with pytest.raises(ValueError, match="max running"):
            tiny_engine.set_max_running(5)
    finally:
        tiny_engine.set_max_running(4)
    tiny_engine.pool.check_invariants()


def test_small_kv_pool_makes_requests_wait_not_corrupt(hf_model_dir, tiny_engine):
    # Room for about one request at a time: the rest must queue and still come out right.
    small = Engine.from_pretrained(hf_model_dir, EngineConfig(max_running_requests=4, max_prefill_tokens=64,
                                                              max_model_len=256, page_size=8, num_pages=8))
    prompts = _prompts(tiny_engine, 5, seed=3)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    got = small.generate(prompts, params)
    want = tiny_engine.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    with pytest.raises(InvalidRequestError, match="whole pool"):
        small.add_request(prompts[0], SamplingParams(max_new_tokens=200))
    small.pool.check_invariants()


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_engine):
    p = _prompts(tiny_engine, 1, seed=5)[0]
    mk = lambda seed: SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
    alone = tiny_engine.generate([p], mk(7))[0].token_ids
    mixed = tiny_engine.generate([p, p, p], [mk(7), mk(8), mk(7)])
    assert mixed[0].token_ids == alone == mixed[2].token_ids
    assert mixed[1].token_ids != alone


def test_stop_token_ids_and_strings(tiny_engine):
    p = _prompts(tiny_engine, 1, seed=11)[0]
    full = tiny_engine.generate([p], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    r = tiny_engine.generate([p], SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(stop_id,)))[0]
    assert r.token_ids == full.token_ids[: first + 1] and r.finish_reason == "stop"
    # A stop string taken from the middle of the text ends generation; it is not in the output.
    text = full.text
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    r = tiny_engine.generate([p], SamplingParams(max_new_tokens=20, ignore_eos=True, stop=(stop,)))[0]
    assert r.finish_reason == "stop" and r.text == text[: text.find(stop)]
    assert full.token_ids[: len(r.token_ids)] == r.token_ids


def test_eos_stops_unless_ignored(tiny_engine):
    p = _prompts(tiny_engine, 1, seed=12)[0]
    full = tiny_engine.generate([p], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    eos = full.token_ids[3]
    engine_eos = tiny_engine.eos_ids
    tiny_engine.eos_ids = frozenset({eos})
    try:
        r = tiny_engine.generate([p], SamplingParams(max_new_tokens=16))[0]
    finally:
        tiny_engine.eos_ids = engine_eos
    assert r.token_ids == full.token_ids[: full.token_ids.index(eos) + 1] and r.finish_reason == "stop"


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", None, "empty"),
        ([], None, "empty"),
        ([5, 10**6], None, "outside the vocabulary"),
        ([5, -1], None, "outside the vocabulary"),
        ([5] * 256, None, "context"),
        ([5], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([5], SamplingParams(temperature=-1.0), "temperature"),
        ([5], SamplingParams(top_p=0.0), "top_p"),
        ([5], SamplingParams(top_k=-2), "top_k"),
        ("x", SamplingParams(stop=("",)), "stop"),
    ],
)
def test_bad_inputs_raise_clear_errors_and_harm_nothing(tiny_engine, prompt, params, match):
    good = _prompts(tiny_engine, 1, seed=13)[0]
    with pytest.raises(InvalidRequestError, match=match):
        tiny_engine.generate([good, prompt], [GREEDY, params or GREEDY])
    assert not tiny_engine.has_unfinished()
    assert tiny_engine.generate([good], GREEDY)[0].finish_reason == "length"


def test_generation_stops_at_context_length(tiny_engine):
    p = [7] * (tiny_engine.max_model_len - 3)
    r = tiny_engine.generate([p], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert len(r.token_ids) == 3 and r.finish_reason == "length"


def test_no_compilation_after_startup(tiny_engine, caplog):
    prompts = _prompts(tiny_engine, 6, seed=21)
    tiny_engine.generate(prompts, GREEDY)  # warm any host-side eager paths
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        tiny_engine.generate(prompts, [GREEDY, SamplingParams(max_new_tokens=5, temperature=0.8, seed=1)] * 3)
    compiles = [r.message for r in caplog.records if "Compiling" in r.message]
    assert not compiles, compiles


def test_host_chosen_sampling_variants_serve_mixed_batches(tiny_engine, caplog):
    """Decode buckets are compiled for greedy and for sampling batches and picked on the host per
    step: both serve steps, nothing compiles after start-up, and a request's tokens do not depend
    on which variant its batch ran (each prompt alone gives what the mixed batch gave it)."""
    eng = tiny_engine
    decode = [(b, b, p) for b in eng.decode_buckets for p in eng.page_widths]
    assert all((*d, v) in eng.worker._compiled for d in decode for v in ("greedy", "stochastic"))
    prompts = _prompts(eng, 6, seed=22)
    mixed = [GREEDY, SamplingParams(max_new_tokens=9, temperature=0.9, top_k=20, top_p=0.9, seed=4)] * 3
    eng.generate(prompts[:2], GREEDY)  # warm host paths
    seen, run = [], eng.worker.run

    def recording(batch, sampling, variant, fn=None):
        seen.append(variant)
        return run(batch, sampling, variant, fn)

    eng.worker.run = recording
    try:
        with jax.log_compiles(True), caplog.at_level(logging.WARNING):
            got = [r.token_ids for r in eng.generate(prompts, mixed)]
        assert not [r.message for r in caplog.records if "Compiling" in r.message]
        assert {"greedy", "stochastic"} <= set(seen)  # both variants served steps
        alone = [eng.generate(p, sp)[0].token_ids for p, sp in zip(prompts, mixed)]
    finally:
        del eng.worker.run
    assert got == alone


def test_results_carry_timing_stats(tiny_engine):
    r = tiny_engine.generate(_prompts(tiny_engine, 1, seed=4), GREEDY)[0]
    s = r.stats
    assert s["completion_tokens"] == 12 and s["ttft_s"] > 0 and s["latency_s"] >= s["ttft_s"]
    assert s["decode_tokens_per_s"] > 0
    assert tiny_engine.last_generate_stats["completion_tokens"] == 12


@pytest.mark.parametrize("split", [True, False], ids=["large-layers-split", "small-layers-stacked"])
def test_unrolled_decode_and_lazy_compile_give_identical_tokens(hf_model_dir, tiny_engine, split, monkeypatch):
    from dspark_jax.layers import layer_split

    if split:  # as if these small layers were large
        monkeypatch.setattr(layer_split, "SPLIT_MIN_LAYER_BYTES", 0)
    eng = Engine.from_pretrained(hf_model_dir, EngineConfig(max_running_requests=4, max_prefill_tokens=64,
                                                            max_model_len=256, unroll_decode=True, precompile=False))
    assert not eng.worker._compiled
    # An unrolling engine splits large layers' weights: its steps take one array per layer where
    # the scanning engine's take one [L, ...] stack (layers/layer_split.py).  Small layers stay
    # stacked: decode unrolls over the stacks, prefill scans.
    L = eng.config.num_hidden_layers
    stacked = [x.shape for x in tiny_engine.runner.state if x.ndim >= 2 and x.shape[0] == L]
    assert eng.runner.split == split and not tiny_engine.runner.split and stacked
    shapes = [x.shape for x in eng.runner.state]
    per_layer = [s[1:] for s in stacked for _ in range(L)] if split else stacked
    assert sorted(shapes) == sorted([s for s in (x.shape for x in tiny_engine.runner.state) if s not in stacked] + per_layer)
    assert eng.runner.forward_options(True)["scan_layers"] is not split  # split: prefill unrolls too
    assert eng.runner.forward_options(False)["scan_layers"] is False
    prompts = _prompts(tiny_engine, 5, seed=31)
    assert [r.token_ids for r in eng.generate(prompts, GREEDY)] == [r.token_ids for r in tiny_engine.generate(prompts, GREEDY)]
    assert eng.worker._compiled  # compiled on first use


def test_pallas_kernels_give_identical_tokens(hf_model_dir, tiny_engine):
    eng = Engine.from_pretrained(hf_model_dir, EngineConfig(max_running_requests=4, max_prefill_tokens=64,
                                                            max_model_len=256, precompile=False, kernels="pallas"))
    assert eng.config.hidden_size & (eng.config.hidden_size - 1) == 0  # a width the fused kernel takes
    assert eng.config.head_dim & (eng.config.head_dim - 1) == 0  # and the kv write kernel
    runner = eng.runner
    assert (runner.backend, runner.norm_backend, runner.kv_write_backend) == ("pallas",) * 3
    # the default ("auto") is the XLA path off the GPU
    expected = "pallas" if jax.default_backend() == "gpu" else "reference"
    assert (tiny_engine.runner.norm_backend, tiny_engine.runner.kv_write_backend) == (expected, expected)
    prompts = _prompts(tiny_engine, 3, seed=32)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert [r.token_ids for r in eng.generate(prompts, params)] == [r.token_ids for r in tiny_engine.generate(prompts, params)]
    with pytest.raises(ValueError, match="kernels"):
        Engine.from_pretrained(hf_model_dir, EngineConfig(max_model_len=64, precompile=False, kernels="triton"))


def test_overlapped_decode_equals_synchronous_decode(hf_model_dir, tiny_engine):
    """Dispatching step t+1 before reading step t must not change a single token, whatever
    finishes when (mixed lengths, stop ids, sampling, more requests than slots)."""
    sync = Engine.from_pretrained(hf_model_dir, EngineConfig(max_running_requests=4, max_prefill_tokens=64,
                                                             max_model_len=256, overlap=False))
    prompts = _prompts(tiny_engine, 9, seed=41)
    params = [SamplingParams(max_new_tokens=3 + 2 * i, temperature=0.8 * (i % 2), seed=i, ignore_eos=True,
                             stop_token_ids=(7,) if i % 3 == 0 else ()) for i in range(9)]
    got = tiny_engine.generate(prompts, params)
    want = sync.generate(prompts, params)
    assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in want]
    assert tiny_engine.pool.num_free_pages == tiny_engine.pool.num_usable_pages


def test_text_is_the_same_read_every_commit_or_once(tiny_engine):
    """Without stop strings a request detokenizes when its text is read: a streaming reader (every
    commit) and a batch reader (once, at the end) see the same text, the tokenizer's own decode."""
    from dspark_jax.engine.request import Request

    p = _prompts(tiny_engine, 1, seed=13)[0]
    ids = tiny_engine.generate([p], SamplingParams(max_new_tokens=40, ignore_eos=True))[0].token_ids
    tok = tiny_engine.tokenizer
    mk = lambda: Request("r", [1, 2], SamplingParams(max_new_tokens=len(ids), ignore_eos=True), 0, tok,
                         frozenset(), max_model_len=1024)
    streamed, batch = mk(), mk()
    seen = ""
    for i in range(0, len(ids), 3):  # commits of 3 tokens, as a speculative round gives
        streamed.append_tokens(ids[i : i + 3])
        batch.append_tokens(ids[i : i + 3])
        assert streamed.text.startswith(seen)
        seen = streamed.text
    assert streamed.finish_reason == batch.finish_reason == "length"
    assert streamed.text == batch.text == tok.decode(ids)


def test_abort_forgets_running_and_waiting_requests(hf_model_dir):
    eng = Engine.from_pretrained(hf_model_dir, EngineConfig(max_running_requests=1, max_prefill_tokens=64,
                                                            max_model_len=256, precompile=False))
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    eng.add_request([5, 6, 7], params, request_id="run")
    eng.add_request([5, 6, 8], params, request_id="wait")  # one slot: this one waits
    for _ in range(3):
        eng.step()
    assert eng.get_request("run").output_ids and not eng.get_request("wait").output_ids
    for rid in ("wait", "run"):
        eng.abort(rid)
        assert eng.get_request(rid) is None
    assert not eng.has_unfinished()
    # The ids are free again, and the pool holds no page of the aborted requests.
    eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True), request_id="run")
    while eng.has_unfinished():
        eng.step()
    eng.pool.check_invariants()
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages
