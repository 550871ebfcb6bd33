"""Logit processors and logprobs: the processed target distribution against a hand-written numpy
reference, raw logprobs against an independent dense forward, and every speculative arm
committing exactly the plain engine's tokens (T = 0) or its distribution (T > 0)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.errors import InvalidRequestError
from dspark_jax.logit_processors import allocate_logit_state, commit_counts, install, install_arrays, process
from dspark_jax.logprobs import token_logprobs
from dspark_jax.models.qwen3 import Qwen3ForCausalLM, forward_dense
from dspark_jax.sampling import SamplingParams
from dspark_jax.spec.config import SpeculativeConfig
from dspark_jax.tiny_model import tiny_config
from dspark_jax.tokenizer import Tokenizer
from tests.stats import assert_counts_fit
from tests.test_mtp_engine import repeat_drafter
from tests.test_speculative_engine import TABLE, repeat_biased_drafter
from tests.tiny_engines import EC, SAMPLING_ARMS, sampling_engine

EOS = 0  # the tiny model's


# -- the reference -----------------------------------------------------------------------------
def reference_logits(logits, params: SamplingParams, prompt, generated, stop_ids=()):
    """The processed logits of one row, by the definitions: bias, then EOS / stop ids at -inf while
    fewer than min_tokens are generated, then the repetition penalty over prompt and generated
    tokens, then frequency and presence over generated ones."""
    out = np.asarray(logits, np.float64).copy()
    for t, b in params.logit_bias.items():
        out[t] += b
    if len(generated) < params.min_tokens:
        for t in stop_ids:
            out[t] = -np.inf
    counts = np.zeros(len(out))
    for t in generated:
        counts[t] += 1
    for t in set(prompt) | set(generated):
        out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
    return out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x[np.isfinite(x)].max()
    return x - m - np.log(np.exp(x - m).sum())


def test_processed_logits_match_the_reference():
    """Installed slots, counted tokens and a verify window's earlier drafts (the priors) give the
    reference's logits row by row; rows without a slot stay raw."""
    rng = np.random.default_rng(0)
    V, slots, max_len, G = 40, 3, 16, 4
    state = allocate_logit_state(slots, V)
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.6,
                             logit_bias={3: 2.5, 7: -100.0, 11: 0.5}, min_tokens=6, max_new_tokens=20),
              SamplingParams(repetition_penalty=0.6, logit_bias={5: -1.0}),
              SamplingParams(frequency_penalty=1.5, min_tokens=2)]
    prompts = [rng.integers(0, V, 9).tolist(), rng.integers(0, V, 4).tolist(), rng.integers(0, V, 12).tolist()]
    stops = [(0, 3, 9), (0,), (1, 2)]
    generated = [rng.integers(0, V, 3).tolist(), rng.integers(0, V, 7).tolist(), [1]]
    for s, (p, prompt, stop) in enumerate(zip(params, prompts, stops)):
        p.validate(vocab_size=V)
        state = install(state, install_arrays(p, prompt, stop, s, vocab=V, max_len=max_len))
    for s, g in enumerate(generated):
        state = commit_counts(state, jnp.array([s]), jnp.array([g]), jnp.ones((1, len(g)), bool))
    N = 9
    row_slot = np.array([0, 0, 1, 2, 2, -1, 0, 1, 2], np.int32)
    priors = rng.integers(0, V, (N, G)).astype(np.int32)
    priors[6] = [3, 3, 3, 9]  # repeats and a stop id among a window's drafts
    priors[4] = [1, 1, 2, 1]
    n_prior = np.array([0, 2, 4, 0, 3, 2, 4, 0, 4])
    valid = np.arange(G)[None, :] < n_prior[:, None]
    position = np.array([len(prompts[max(s, 0)]) + len(generated[max(s, 0)]) + n for s, n in zip(row_slot, n_prior)])
    logits = rng.standard_normal((N, V)).astype(np.float32) * 3
    got = np.asarray(process(jnp.asarray(logits), state, jnp.asarray(row_slot), jnp.asarray(position),
                             jnp.asarray(priors), jnp.asarray(valid)))
    for n, s in enumerate(row_slot):
        if s < 0:
            np.testing.assert_array_equal(got[n], logits[n])
            continue
        gen = generated[s] + priors[n, : n_prior[n]].tolist()
        want = reference_logits(logits[n], params[s], prompts[s], gen, stops[s])
        np.testing.assert_array_equal(np.isinf(got[n]), np.isinf(want))
        np.testing.assert_allclose(got[n][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)
    # the stop ids are masked below min_tokens and only there
    assert np.isinf(got[0, [0, 3, 9]]).all() and np.isinf(got[3, [1, 2]]).all() and np.isfinite(got[4, [1, 2]]).all()
    lp = token_logprobs(jnp.asarray(logits), jnp.arange(N, dtype=jnp.int32))
    ref = np.stack([log_softmax(x) for x in logits])
    np.testing.assert_allclose(np.asarray(lp.logprob), ref[np.arange(N), np.arange(N)], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(lp.top_ids), np.argsort(-ref, axis=1)[:, :20])


@pytest.mark.parametrize("kw, match", [
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=1e-30), "repetition_penalty"), (dict(presence_penalty="1"), "presence_penalty"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=9, max_new_tokens=8), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"), (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "outside the vocabulary"),
    (dict(logit_bias={"x": 1.0}), "integer token ids"), (dict(logit_bias={i: 1.0 for i in range(301)}), "at most 300"),
    (dict(logit_bias=[(1, 2.0)]), "mapping"), (dict(logit_bias={"5": 1.0, 5: 2.0}), "twice"),
])
def test_out_of_range_values_are_refused(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw).validate()


def test_validation_normalizes_bias_keys():
    p = SamplingParams(logit_bias={"7": 1, 3: -2.5}, min_tokens=4, presence_penalty=1)
    p.validate(vocab_size=10)
    assert p.logit_bias == {7: 1.0, 3: -2.5} and p.processes_logits and p.needs_processed_steps
    assert not SamplingParams().needs_processed_steps and SamplingParams(logprobs=0).needs_processed_steps
    assert not SamplingParams(logprobs=0).processes_logits


# -- the engines -----------------------------------------------------------------------------
def _mixed(n=16):
    """Four requests sharing one batch: two with penalties (one small enough that a run of repeats
    flips the argmax inside a verify window), one with none, one whose EOS a logit bias makes
    the argmax from the start, held off by min_tokens."""
    return [SamplingParams(max_new_tokens=n, ignore_eos=True, frequency_penalty=0.12, logprobs=3),
            SamplingParams(max_new_tokens=n, ignore_eos=True, repetition_penalty=2.0, presence_penalty=-0.3),
            SamplingParams(max_new_tokens=n, ignore_eos=True),
            SamplingParams(max_new_tokens=n, logit_bias={EOS: 12.0, 9: -100.0}, min_tokens=5, logprobs=0)]


def _prompts(n=4, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, size=int(rng.integers(2, 25))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def reference(plain, target):
    """The plain engine's results on the mixed batch, and each request's raw target logits at every
    generated position from a dense forward over prompt + output."""
    prompts, params = _prompts(), _mixed()
    results = plain.generate(prompts, params)
    dense = []
    for p, r in zip(prompts, results):
        ids = jnp.asarray([p + r.token_ids])
        h = forward_dense(target, ids, jnp.arange(ids.shape[1])[None]).hidden
        dense.append(np.asarray(target.logits(h))[0, len(p) - 1: len(p) - 1 + len(r.token_ids)])
    return prompts, params, results, dense


def _check_logprobs(results, params, dense):
    """Each result's logprobs are the log-softmax of the dense forward's raw logits."""
    for r, p, rows in zip(results, params, dense):
        if p.logprobs is None:
            assert r.logprobs is None and r.top_logprobs is None
            continue
        ref = np.stack([log_softmax(x) for x in rows])
        assert len(r.logprobs) == len(r.top_logprobs) == len(r.token_ids)
        np.testing.assert_allclose(r.logprobs, ref[np.arange(len(rows)), r.token_ids], atol=2e-4)
        for i, top in enumerate(r.top_logprobs):
            assert len(top) == p.logprobs
            ids, vals = zip(*top) if top else ((), ())
            np.testing.assert_allclose(vals, ref[i][list(ids)], atol=2e-4)  # each pair is right
            np.testing.assert_allclose(vals, np.sort(ref[i])[::-1][: p.logprobs], atol=2e-4)  # and they are the top


def test_plain_engine_follows_the_reference(reference, plain):
    """Greedy tokens are the argmax of the reference's processed logits at every position; EOS,
    the biased argmax, is held off for exactly min_tokens; logprobs are raw."""
    prompts, params, results, dense = reference
    stops = [(), (), (), (EOS,)]
    for p, prompt, r, rows, stop in zip(params, prompts, results, dense, stops):
        for i, t in enumerate(r.token_ids):
            want = reference_logits(rows[i], p, prompt, r.token_ids[:i], stop)
            assert want[t] >= want.max() - 1e-4, (i, t, int(want.argmax()))
    assert results[3].token_ids[-1] == EOS and len(results[3].token_ids) == 6 and results[3].finish_reason == "stop"
    assert EOS not in results[3].token_ids[:5]
    assert len(set(results[0].token_ids)) > 2  # the penalty broke the repeat loop
    _check_logprobs(results, params, dense)
    assert {k[3] for k in plain.worker._compiled} >= {"processed"}  # compiled on first use ("lazy")


ARMS = {
    "static": dict(mode="static"),
    "compact": dict(mode="compact", cost_table=TABLE),
    "cap-accept": dict(mode="cap-accept", cost_table=TABLE),
    "static-2-rounds": dict(mode="static", rounds_per_call=2),
    "decode-rounds": dict(mode="compact", cost_table=TABLE.with_decode([1, 4], [1e-5, 2e-5])),
    "mtp": dict(algorithm="mtp", num_steps=3),
}


def _engine(target, tok, arm: str, ec=None):
    spec = SpeculativeConfig(**ARMS[arm])
    drafter = repeat_drafter(target) if spec.algorithm == "mtp" else repeat_biased_drafter(target)
    return Engine(target, tok, ec or EngineConfig(**EC), drafter=drafter, spec=spec)


@pytest.mark.parametrize("arm", list(ARMS))
def test_speculative_arms_commit_the_plain_tokens(reference, target, model_dir, arm):
    """At T = 0 every arm commits exactly the plain engine's tokens for requests with processors
    and for the one without, in one batch, and returns the same raw logprobs."""
    prompts, params, want, dense = reference
    eng = _engine(target, Tokenizer.from_folder(model_dir), arm)
    got = eng.generate(prompts, params)
    for g, w in zip(got, want):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    _check_logprobs(got, params, dense)
    acc = [g.stats["spec"]["accept_lens"] for g in got]
    if arm == "decode-rounds":
        assert {a for lens in acc for a in lens} == {1}
    else:  # windows of processed requests really committed drafts
        assert max(acc[0]) >= 2, acc
    keys = [k for k in eng.worker._compiled if k[0] == "round"]
    assert any(k[-1] for k in keys)  # processed rounds ran
    eng.pool.check_invariants()


def test_unprocessed_batches_keep_their_executables(model_dir, target):
    """A batch without processors or logprobs never runs a processed executable; with
    logit_processors "precompile" the processed ones compile at start-up and a processed batch
    compiles nothing more; "off" refuses such requests.  Ids past the real vocabulary are refused."""
    ec = dict(EC, max_running_requests=2, max_prefill_tokens=16, precompile=True)
    eng = Engine.from_pretrained(model_dir, EngineConfig(**ec, logit_processors="precompile"))
    assert {k[3] for k in eng.worker._compiled} == {"any", "greedy", "stochastic", "processed"}
    prompts = _prompts(2, seed=5)
    eng.runner.take_compile_spans()
    eng.generate(prompts, [_mixed(6)[0], _mixed(6)[2]])
    assert not eng.runner.take_compile_spans()
    lazy = Engine.from_pretrained(model_dir, EngineConfig(**ec))
    assert "processed" not in {k[3] for k in lazy.worker._compiled}
    seen, run = [], lazy.worker.run
    lazy.worker.run = lambda batch, sampling, variant, fn=None: seen.append(variant) or run(batch, sampling, variant, fn)
    lazy.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert "processed" not in seen
    off = Engine.from_pretrained(model_dir, EngineConfig(**ec, logit_processors="off"))
    assert off.processors is None
    assert off.generate(prompts[0], SamplingParams(max_new_tokens=3))[0].logprobs is None
    for bad in (SamplingParams(logprobs=1), SamplingParams(min_tokens=1), SamplingParams(logit_bias={4: 1.0})):
        with pytest.raises(InvalidRequestError, match="logit_processors"):
            off.generate(prompts[0], bad)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        eng.generate(prompts[0], SamplingParams(logit_bias={eng.num_tokens: 1.0}))
    with pytest.raises(ValueError, match="logit_processors"):
        EngineConfig(logit_processors="eager").validate()
    for arm in ("static", "mtp"):  # speculative engines list a processed twin of every round executable
        labels = [label for label, _ in _engine(target, None, arm, EngineConfig(**EC, logit_processors="precompile"))
                  .executables()]
        rounds = [label for label in labels if " round " in label]
        assert "logit processors install" in labels
        assert 2 * sum(label.endswith(" processed") for label in rounds) == len(rounds) > 0


def test_min_tokens_holds_off_eos_and_stop_strings(plain, model_dir, target):
    """A stop id greedy would emit at once and a biased EOS wait for min_tokens (stop strings too)
    in the plain engine and in a speculative one."""
    prompt = _prompts(1, seed=9)[0]
    free = plain.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    first = free[0]
    stopped = plain.generate(prompt, SamplingParams(max_new_tokens=8, stop_token_ids=(first,), ignore_eos=True))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = SamplingParams(max_new_tokens=12, stop_token_ids=(first,), min_tokens=4, ignore_eos=True)
    eng = _engine(target, Tokenizer.from_folder(model_dir), "static")
    for e in (plain, eng):
        r = e.generate(prompt, held)[0]
        assert len(r.token_ids) >= 4 and first not in r.token_ids[:4]
        assert r.finish_reason == "length" or r.token_ids[-1] == first
    text = plain.tokenizer.decode(free[:1])
    if text:  # a stop string the first token completes counts only from min_tokens on
        r = plain.generate(prompt, SamplingParams(max_new_tokens=8, stop=(text,), min_tokens=3, ignore_eos=True))[0]
        assert len(r.token_ids) >= 3


# -- T > 0: the distribution ---------------------------------------------------------------------
SAMPLED = dict(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.4,
               logit_bias={1: 1.0, 4: -0.7}, min_tokens=2, stop_token_ids=(5,), ignore_eos=True)


@pytest.fixture(scope="module")
def small_target():
    """A 6-token target with sharp distributions (as the sampling test of the speculative engine)."""
    cfg = tiny_config(6, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, eos_token_ids=())
    t = Qwen3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    t.embed_tokens.embedding[...] = t.embed_tokens.embedding[...] * 8
    return t


@pytest.mark.parametrize("arm", SAMPLING_ARMS)
def test_sampled_tokens_follow_the_processed_distribution(small_target, arm):
    """The joint law of the first three tokens (one from prefill, two from decode steps or rounds,
    whose windows count earlier drafts) is the reference's processed, tempered distribution."""
    V, target = 6, small_target
    prompt = [1, 4, 2]
    seqs = np.array([prompt + [a, b] for a in range(V) for b in range(V)])
    h = forward_dense(target, jnp.asarray(seqs), jnp.tile(jnp.arange(5), (len(seqs), 1))).hidden
    raw = np.asarray(target.logits(h), np.float64)  # [V*V, 5, V]
    p = SamplingParams(max_new_tokens=3, **SAMPLED)

    def dist(row, gen):
        x = reference_logits(row, p, prompt, gen, stop_ids=(5,)) / p.temperature
        return np.exp(log_softmax(x))

    joint = np.zeros((V, V, V))
    for a in range(V):
        for b in range(V):
            seq = a * V + b
            joint[a, b] = dist(raw[seq, 2], [])[a] * dist(raw[seq, 3], [a])[b] * dist(raw[seq, 4], [a, b])
    eng = sampling_engine(target, arm)
    n = 6000
    res = eng.generate([prompt] * n, [SamplingParams(max_new_tokens=3, seed=i, **SAMPLED) for i in range(n)])
    counts = np.zeros((V, V, V))
    for r in res:
        assert len(r.token_ids) == 3 and 5 not in r.token_ids[:2]
        counts[tuple(r.token_ids)] += 1
    assert_counts_fit(counts, joint * n)
    if arm != "plain":
        assert np.mean(eng.stats["accept_lens"]) > 1.1  # drafts were accepted along the way


def test_logprobs_cover_the_top_of_a_small_vocabulary(small_target):
    """A request may ask for more alternatives than a 6-token vocabulary holds: it gets all six."""
    eng = Engine(small_target, None, EngineConfig(max_running_requests=2, max_model_len=32, page_size=4,
                                                  precompile=False))
    r = eng.generate([1, 2], SamplingParams(max_new_tokens=3, logprobs=20, ignore_eos=True))[0]
    assert [len(t) for t in r.top_logprobs] == [6, 6, 6]
    np.testing.assert_allclose([sum(np.exp(v) for _, v in t) for t in r.top_logprobs], 1.0, rtol=1e-5)
    assert r.to_json()["logprobs"] == r.logprobs


# -- the embedded default pair -------------------------------------------------------------------
@pytest.mark.parametrize("arm", ["compact", "mtp"])
def test_default_pair_with_processors_equals_plain(arm):
    """The trained drafters, whose drafts are mostly right, over a batch of requests with and
    without processors: the same tokens and logprobs as the plain engine, with multi-token rounds."""
    from dspark_jax.default_model import default_drafter_path, default_model_path, default_mtp_path
    from tests.test_default_pair import EC as DEFAULT_EC
    from tests.test_default_pair import PROMPTS
    from tests.test_default_pair import TABLE as DEFAULT_TABLE

    if default_drafter_path() is None or default_mtp_path() is None:
        pytest.skip("the embedded drafters are not in this tree")
    prompts = [PROMPTS[i] for i in (1, 0, 2, 4)]  # code, math, verse, math
    eos = 2  # the default model's; biased to the argmax, then held off by min_tokens
    params = [SamplingParams(max_new_tokens=32, frequency_penalty=2.0, presence_penalty=1.0, logprobs=5),
              SamplingParams(max_new_tokens=32, repetition_penalty=2.0, presence_penalty=0.5),
              SamplingParams(max_new_tokens=32),
              SamplingParams(max_new_tokens=32, min_tokens=20, logit_bias={eos: 100.0, 13: -100.0}, logprobs=0)]
    plain = Engine.from_pretrained(default_model_path(), DEFAULT_EC)
    want = plain.generate(prompts, params)
    if arm == "mtp":
        eng = Engine.from_pretrained(default_model_path(), DEFAULT_EC, SpeculativeConfig(algorithm="mtp"),
                                     draft_path=default_mtp_path())
    else:
        eng = Engine.from_pretrained(default_model_path(), DEFAULT_EC,
                                     SpeculativeConfig(mode=arm, cost_table=DEFAULT_TABLE),
                                     draft_path=default_drafter_path())
    got = eng.generate(prompts, params)
    for g, w in zip(got, want):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
        if w.logprobs is not None:
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
            assert [[t for t, _ in top] for top in g.top_logprobs] == [[t for t, _ in top] for top in w.top_logprobs]
    assert len(want[3].token_ids) == 21 and want[3].token_ids[-1] == eos and want[3].finish_reason == "stop"
    free = plain.generate(prompts, SamplingParams(max_new_tokens=32))
    assert all(free[i].token_ids != want[i].token_ids for i in (0, 1, 3))  # the processors changed the text
    assert max(a for g in got[:2] for a in g.stats["spec"]["accept_lens"]) > 2
