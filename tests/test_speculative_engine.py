"""Speculative decoding is lossless: at temperature 0 every mode commits exactly plain greedy."""

from __future__ import annotations

import bisect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dspark_jax.engine.engine as engine_module
from dspark_jax.checkpoint import load_model
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.layers.layer_split import is_split
from dspark_jax.sampling import SamplingParams
from dspark_jax.spec.common.stats import round_seconds
from dspark_jax.spec.config import SpeculativeConfig
from dspark_jax.spec.dspark.config import DSparkConfig
from dspark_jax.spec.dspark.cost_model import AdditiveCostTable
from dspark_jax.spec.dspark.model import DSparkDrafter
from dspark_jax.spec.dspark.synthetic import synthetic_round, time_round
from dspark_jax.tokenizer import Tokenizer
from tests.stats import assert_counts_fit

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
EC = dict(max_running_requests=4, max_prefill_tokens=64, max_model_len=256, page_size=8)
# Engines compile each executable on first use unless a test checks what start-up compiles (those
# pass EngineConfig(**EC)): the executables are the same either way, only fewer of them get built.
LAZY = dict(EC, precompile=False)


def repeat_biased_drafter(target, gamma=4, strength=6.0, seed=0):
    """A random drafter whose vanilla Markov head favours repeating the previous token: random
    tiny targets loop on a few tokens, so drafts get accepted often enough to exercise every
    branch (full accepts, partial accepts, immediate rejections)."""
    V = target.config.vocab_size
    cfg = DSparkConfig.from_target(target.config, num_layers=1, block_size=gamma, mask_token_id=3,
                                   markov_rank=V, target_layer_ids=(0,))
    d = DSparkDrafter(cfg, rngs=nnx.Rngs(seed))
    d.markov.w1.embedding[...] = jnp.eye(V, dtype=jnp.float32)
    d.markov.w2.kernel[...] = strength * jnp.eye(V, dtype=jnp.float32)
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dspark_jax.tiny_model import write_tiny_model

    # Small-init random weights: greedy continuations loop, as untrained models do.
    return write_tiny_model(tmp_path_factory.mktemp("spec") / "m", vocab_size=300, max_position_embeddings=512)


@pytest.fixture(scope="module")
def pair(model_dir):
    _, target = load_model(model_dir)
    return target, Tokenizer.from_folder(model_dir), repeat_biased_drafter(target)


@pytest.fixture(scope="module")
def plain(model_dir):
    return Engine.from_pretrained(model_dir, EngineConfig(**LAZY))


def dspark(pair, config=None, **spec):
    """A DSpark engine over the test pair."""
    target, tok, drafter = pair
    return Engine(target, tok, config or EngineConfig(**LAZY), drafter=drafter, spec=SpeculativeConfig(**spec))


def _prompts(vocab, n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(1, 30))).tolist() for _ in range(n)]


# A staircase table that makes trimming worthwhile: per-token cost dominates.
TABLE = AdditiveCostTable(bias_seconds=1e-3, bs_probes=(1, 4), alpha_seconds=(0.0, 1e-4),
                          m_probes=(1, 8, 40), theta_seconds=(0.0, 4e-3, 3e-2))


@pytest.mark.parametrize("mode, table, rounds", [("static", None, 1), ("compact", None, 1), ("compact", TABLE, 1),
                                                ("cap-accept", TABLE, 1), ("static", None, 2), ("compact", TABLE, 3)])
def test_greedy_speculation_equals_plain_greedy(pair, plain, mode, table, rounds):
    """rounds: rounds per dispatch (rounds_per_call), each fed by the one before on the device."""
    target, tok, drafter = pair
    eng = dspark(pair, mode=mode, cost_table=table, rounds_per_call=rounds)
    prompts = _prompts(target.config.vocab_size, 7, seed=hash(mode) % 100)
    got = eng.generate(prompts, GREEDY)
    want = plain.generate(prompts, GREEDY)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
    acc = np.asarray(eng.stats["accept_lens"])
    vl = np.asarray(eng.stats["verify_lens"])
    assert acc.max() >= 3  # real multi-token speculation happened
    assert len(eng.stats["round_log"]) == eng.stats["rounds"] and eng.worker._step == eng.stats["rounds"]
    assert eng.worker.scheduler.lag == max(2, 2 * rounds)  # each round's budget from survival already read
    if table is None or mode == "static":
        assert (vl == drafter.config.block_size + 1).all()
        assert acc.mean() > 1.3 and acc.max() == drafter.config.block_size + 1
    elif mode == "compact":
        assert vl.min() < drafter.config.block_size + 1  # windows really were trimmed
    if mode == "cap-accept":
        assert (np.asarray(eng.stats["block_accept_lens"]) >= acc).all()
    for g in got:  # per-request stats add up to what was generated
        sp = g.stats["spec"]
        assert sum(sp["accept_lens"]) + 1 >= len(g.token_ids) and sp["verify_ct"] == len(sp["accept_lens"])
        assert sum(sp["window_histogram"]) == sp["verify_ct"] and 0 < sp["utilization"] <= 1
    eng.pool.check_invariants()
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages
    # Rejected drafts and padding rows are dropped from the draft cache's writes, never aimed at
    # its sentinel page (where their colliding writes made the scatter slow on the GPU).
    assert not np.asarray(eng.worker.dcache.k[:, 0]).any() and not np.asarray(eng.worker.dcache.v[:, 0]).any()
    summ = eng.summary()
    assert summ["rounds"] == eng.stats["rounds"] and abs(summ["accept_length"] - acc.mean()) < 1e-9
    if mode != "compact":  # uncensored labels: per-position calibration metrics are reported
        assert len(summ["confidence"]["ece"]) == drafter.config.block_size
    if table is not None:
        assert summ["step_time"]["predicted_mean_s"] > 0


def test_default_tiers_include_finer_tiers_than_the_ladder(pair):
    """A trimmed 64-request batch must drop to a smaller executable than verify-all even when its
    budget stays above half the block: the default adds tiers every 64 tokens at this size."""
    G = pair[2].config.block_size
    eng = dspark(pair, EngineConfig(**{**EC, "max_running_requests": 64, "precompile": False}), mode="compact",
                 cost_table=TABLE)
    tiers = eng.worker.tiers
    top = 64 * (G + 1)
    assert tiers.tier_for(64, 64 * G) == top
    assert tiers.tier_for(64, top - 64 - 64) == top - 64  # one 64-token step below verify-all
    assert set(range(64, top + 1, 64)) <= set(tiers.tiers)
    assert {b * (G + 1) for b in eng.decode_buckets} <= set(tiers.tiers)


def test_requests_done_at_their_first_token_free_their_slot(pair, plain):
    """A request that finishes at prefill (max_new_tokens 1) must give its round slot back: more
    of them than there are slots, then a normal batch, all complete and match plain greedy."""
    target = pair[0]
    eng = dspark(pair, mode="static")
    prompts = _prompts(target.config.vocab_size, 3 * EC["max_running_requests"], seed=11)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    assert [r.token_ids for r in eng.generate(prompts, one)] == [r.token_ids for r in plain.generate(prompts, one)]
    assert sorted(eng.scheduler._free_slots) == list(range(EC["max_running_requests"]))
    assert [r.token_ids for r in eng.generate(prompts[:6], GREEDY)] == [r.token_ids for r in plain.generate(prompts[:6], GREEDY)]


@pytest.mark.parametrize("mode, rounds", [("static", 1), ("compact", 1), ("compact", 2)])
def test_overlap_survives_requests_leaving_the_batch(pair, plain, mode, rounds):
    """Requests with different lengths leave the batch one by one; the next round is still
    dispatched before the in-flight one is read (the leavers' rows dropped, the others fed on
    device from their rows of the in-flight round), and every output equals plain greedy.  With
    several rounds per dispatch a request also ends inside a call: its later rounds are ignored."""
    target, _, drafter = pair
    eng = dspark(pair, mode=mode, cost_table=TABLE, rounds_per_call=rounds)
    assert eng.overlap
    shrunk = []
    dispatch = eng.worker.dispatch

    def spy(reqs, prev):
        if prev is not None and len(reqs) < len(prev.reqs):
            shrunk.append((len(prev.reqs), len(reqs)))
        return dispatch(reqs, prev)

    eng.worker.dispatch = spy
    prompts = _prompts(target.config.vocab_size, 4, seed=21)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 13, 22, 31)]
    got = eng.generate(prompts, params)
    want = plain.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert shrunk  # a smaller batch was dispatched on top of an unread round
    assert eng.lookahead == 2 * rounds * (drafter.config.block_size + 1)  # reserved: no write past a request's pages
    eng.pool.check_invariants()
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_admissions_while_rounds_overlap(pair, plain, mode):
    """More requests than slots, of mixed lengths (some done at their first token, some with
    prompts longer than a prefill chunk), admitted while rounds run overlapped.  Greedy output
    equals plain greedy; in static mode, sampled output equals the same engine's without overlap
    (same seeds, same keys; compact's windows depend on the batch, which overlap changes); nothing
    leaks."""
    target = pair[0]
    V = target.config.vocab_size
    rng = np.random.default_rng(41)
    prompts = [rng.integers(3, V, size=int(n)).tolist() for n in (5, 90, 12, 3, 70, 20, 8, 33, 2, 150, 17)]
    lens = [9, 1, 17, 30, 4, 1, 12, 21, 6, 11, 25]
    spec = dict(mode=mode, cost_table=TABLE if mode == "compact" else None)
    eng = dspark(pair, **spec)
    greedy = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens]
    got = eng.generate(prompts, greedy)
    assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(prompts, greedy)]
    assert [g.finish_reason for g in got] == ["length"] * len(prompts)
    sampled = [SamplingParams(max_new_tokens=n, temperature=0.9, top_k=40, seed=100 + i, ignore_eos=True)
               for i, n in enumerate(lens)]
    got = eng.generate(prompts, sampled)
    assert [len(g.token_ids) for g in got] == lens
    if mode == "static":
        serial = dspark(pair, EngineConfig(**LAZY, overlap=False), **spec)
        assert [g.token_ids for g in got] == [g.token_ids for g in serial.generate(prompts, sampled)]
    assert sorted(eng.scheduler._free_slots) == list(range(EC["max_running_requests"])) and eng._inflight is None
    eng.pool.check_invariants()
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages


def test_forced_budget_verifies_exactly_that_many_drafts(pair, plain):
    """The cost profiler's knob: every round of a bs-request batch verifies bs + min(K, bs * gamma)
    tokens, runs the tier of (bs, K), logs (bs, K, tier, seconds), and stays lossless; forced
    "decode", every round is a plain decode step (one token a request, the batch's bucket)."""
    target, _, drafter = pair
    G = drafter.config.block_size
    eng = dspark(pair, mode="compact")
    prompts = _prompts(target.config.vocab_size, 3, seed=8)
    rounds_before = 0
    for K in (0, 5, 3 * G + 7, "decode"):
        eng.worker.force(K)
        eng.stats["round_log"].clear()
        got = eng.generate(prompts, GREEDY)
        assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(prompts, GREEDY)]
        log = list(eng.stats["round_log"])
        assert len(log) == eng.stats["rounds"] - rounds_before
        rounds_before = eng.stats["rounds"]
        for bs, k, tier, verified, seconds, _ in log:
            want = 0 if K == "decode" else min(K, bs * G)
            assert k == want and verified == bs + k and seconds > 0
            assert tier == (eng.decode_buckets[bisect.bisect_left(eng.decode_buckets, bs)] if K == "decode"
                            else eng.worker.tiers.tier_for(bs, k))
    with pytest.raises(ValueError, match="forced budget"):
        eng.worker.force(-1)


def test_synthetic_rounds_commit_nothing_and_give_their_pages_back(pair, plain):
    """The studies' synthetic rounds (spec/dspark/synthetic.py): the compact round of (bs, K)'s
    tier, or a plain decode step of the batch's bucket, dispatched again and again on made-up rows
    whose pages are held only for the call; afterwards the pool is whole and the engine serves
    plain greedy tokens as before."""
    target, _, _ = pair
    eng = dspark(pair, mode="compact")
    free = eng.pool.num_free_pages
    for bs, K in ((3, 5), (2, None)):
        with synthetic_round(eng.worker, bs, K, context=40) as (tier, call):
            assert eng.pool.num_free_pages < free
            jax.block_until_ready([call(), call()])
        assert tier == (eng.worker.tiers.tier_for(bs, K) if K is not None
                        else eng.decode_buckets[bisect.bisect_left(eng.decode_buckets, bs)])
        assert eng.pool.num_free_pages == free
    tier, seconds = time_round(eng.worker, 2, 3, context=40, iters=2, warmup=1)
    assert tier == eng.worker.tiers.tier_for(2, 3) and seconds > 0 and eng.pool.num_free_pages == free
    prompts = _prompts(target.config.vocab_size, 3, seed=21)
    got = eng.generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(prompts, GREEDY)]


@pytest.mark.parametrize("rounds", [1, 2])
def test_trimmed_rounds_verify_up_to_their_tiers_capacity(pair, plain, rounds):
    """A trimmed round runs the tier of its budget, whose padding costs what verified tokens
    would: every round of the call verifies bs + min(tier - bs, bs * gamma) tokens (the top of the
    current survival), is priced at that filled budget, and greedy output is still plain greedy."""
    target, _, drafter = pair
    G = drafter.config.block_size
    eng = dspark(pair, mode="compact", cost_table=TABLE, rounds_per_call=rounds)
    prompts = _prompts(target.config.vocab_size, 6, seed=13)
    got = eng.generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(prompts, GREEDY)]
    log = list(eng.stats["round_log"])
    assert any(k < bs * G for bs, k, *_ in log)  # the table made the scheduler trim
    for bs, k, tier, verified, *_ in log:
        assert k == min(tier - bs, bs * G) and verified == bs + k and tier == eng.worker.tiers.tier_for(bs, k)
    np.testing.assert_allclose(eng.stats["predicted_step_s"], [TABLE.predict(bs, k) for bs, k, *_ in log], rtol=1e-12)


FLAT = AdditiveCostTable(1e-3, (1, 4), (0.0, 1e-4), (1, 8, 40), (2e-4, 2e-4, 2e-4))  # flat in K


def test_round_seconds_leave_out_compiles_and_share_the_call():
    """A call's time runs from its dispatch or the previous read, whichever came later, to its
    read, less compiles made meanwhile (clipped to that span), split over its rounds."""
    assert round_seconds(10.0, 9.0, 12.0, [], 1) == pytest.approx(2.0)  # synchronous: from its dispatch
    assert round_seconds(10.0, 11.0, 12.0, [], 2) == pytest.approx(0.5)  # overlapped: from the last read
    spans = [(9.5, 10.5), (11.0, 11.25), (12.5, 13.0)]  # partly before, inside, after the span
    assert round_seconds(10.0, 9.0, 12.0, spans, 1) == pytest.approx(2.0 - 0.5 - 0.25)
    assert round_seconds(10.0, 9.0, 10.5, [(9.0, 11.0)], 1) == pytest.approx(1e-9)  # never zero or negative


@pytest.mark.parametrize("mode, table, rounds", [("compact", FLAT, 1), ("compact", FLAT, 2), ("compact", None, 1),
                                                 ("cap-accept", None, 1), ("compact", TABLE, 1)])
def test_engines_that_cannot_trim_run_static_rounds(pair, plain, mode, table, rounds):
    """A compact or cap-accept engine whose scheduler can never trim (no cost table, or one flat
    in K under the default guard) verifies every block without ranking or keeping survival (the
    lag ring stays empty), through the static round executables, the only ones it compiles; with
    a table each round is priced at the table's full-block time.  Greedy output is plain greedy.
    A table that prices K keeps the engine's own mode."""
    target, _, drafter = pair
    G = drafter.config.block_size
    eng = dspark(pair, EngineConfig(**EC), mode=mode, cost_table=table, rounds_per_call=rounds)  # what start-up compiles
    prompts = _prompts(target.config.vocab_size, 5, seed=12)
    got = eng.generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(prompts, GREEDY)]
    modes = {key[1] for key in eng.worker._compiled if key[0] == "round"}
    if table is TABLE:
        assert modes == {mode} and eng.worker.scheduler._ring
        return
    assert modes == {"static"} and not eng.worker.scheduler._ring
    log = list(eng.stats["round_log"])
    assert log and all(k == bs * G and verified == bs * (G + 1) for bs, k, _tier, verified, *_ in log)
    assert eng.summary()["confidence"]  # uncensored labels: the online calibration metrics run
    if table is not None:
        np.testing.assert_allclose(eng.stats["predicted_step_s"], [table.predict(bs, bs * G) for bs, *_ in log],
                                   rtol=1e-12)


def test_compact_and_cap_accept_commit_identical_tokens(pair):
    target = pair[0]
    prompts = _prompts(target.config.vocab_size, 6, seed=5)
    params = SamplingParams(max_new_tokens=20, temperature=0.9, seed=3, ignore_eos=True)
    outs = {}
    for mode in ("compact", "cap-accept"):
        outs[mode] = [r.token_ids for r in dspark(pair, mode=mode, cost_table=TABLE).generate(prompts, params)]
    assert outs["compact"] == outs["cap-accept"]


@pytest.mark.parametrize("mode, rounds", [("static", 1), ("compact", 1), ("static", 2)])
def test_sampled_speculation_follows_target_distribution(mode, rounds):
    """Temperature 1 on a 6-token vocabulary: the joint law of the first three generated tokens
    (one from prefill, two from speculative rounds) matches the target's, by chi-square."""
    import jax

    from dspark_jax.models.qwen3 import Qwen3ForCausalLM, forward_dense
    from dspark_jax.tiny_model import tiny_config

    V = 6
    cfg = tiny_config(V, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, eos_token_ids=())
    target = Qwen3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    target.embed_tokens.embedding[...] = target.embed_tokens.embedding[...] * 40  # sharpen the distributions
    drafter = repeat_biased_drafter(target, gamma=3, strength=2.0)
    prompt = [1, 4, 2]
    # Exact joint p(x1, x2, x3 | prompt) from dense forwards over every 2-token prefix.
    seqs = np.array([prompt + [a, b] for a in range(V) for b in range(V)])
    h = forward_dense(target, jnp.asarray(seqs), jnp.tile(jnp.arange(5), (len(seqs), 1))).hidden
    p = np.asarray(jax.nn.softmax(target.logits(h), -1), np.float64)  # [V*V, 5, V]
    joint = np.einsum("a,ab,abc->abc", p[0, 2], p[::V, 3].reshape(V, V), p[:, 4].reshape(V, V, V))
    eng = dspark((target, None, drafter), EngineConfig(max_running_requests=64, max_prefill_tokens=256,
                                                       max_prefill_seqs=64, max_model_len=64, page_size=4,
                                                       precompile=False),
                 mode=mode, cost_table=TABLE if mode == "compact" else None, rounds_per_call=rounds)
    n = 6000
    res = eng.generate([prompt] * n, [SamplingParams(max_new_tokens=3, temperature=1.0, seed=i, ignore_eos=True)
                                      for i in range(n)])
    counts = np.zeros((V, V, V))
    for r in res:
        counts[tuple(r.token_ids)] += 1
    assert_counts_fit(counts, joint * n)
    assert np.mean(eng.stats["accept_lens"]) > 1.2  # drafts were really accepted along the way


@pytest.mark.parametrize("rounds", [1, 2])
def test_no_compilation_after_startup(pair, caplog, rounds):
    import logging

    import jax

    target = pair[0]
    eng = dspark(pair, EngineConfig(**EC), mode="compact", cost_table=TABLE, rounds_per_call=rounds)
    prompts = _prompts(target.config.vocab_size, 6, seed=8)
    eng.generate(prompts[:2], GREEDY)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        eng.generate(prompts, [GREEDY, SamplingParams(max_new_tokens=9, temperature=0.8, seed=2)] * 3)
    compiles = [r.message for r in caplog.records if "Compiling" in r.message]
    assert not compiles, compiles


def test_sts_recording_feeds_the_calibration_cli(pair, tmp_path):
    import subprocess
    import sys

    target, _, drafter = pair
    rec = tmp_path / "sts"
    eng = dspark(pair, mode="static", record_sts_dir=str(rec))
    eng.worker.set_record_group("a")
    eng.generate(_prompts(target.config.vocab_size, 6, seed=11), GREEDY)
    rows_a = eng.stats["rounds"]
    eng.worker.set_record_group("b")
    eng.generate(_prompts(target.config.vocab_size, 2, seed=12), GREEDY)
    eng.worker.flush_records()
    shards = sorted(rec.glob("sts-*.npz"))
    assert shards
    data = np.load(shards[0])
    assert data["logits"].shape[1] == drafter.config.block_size
    assert ((0 <= data["num_accepted_drafts"]) & (data["num_accepted_drafts"] <= drafter.config.block_size)).all()
    from training.calibrate_sts import load_groups

    groups = load_groups(shards)
    # every row carries the group it was recorded under, in order: all of "a" first, then "b"
    assert set(groups) == {"a", "b"} and (groups[:-1] <= groups[1:]).all()
    assert 0 < (groups == "a").sum() <= 6 * rows_a  # at most one row per request per round
    from training.calibrate_sts import load_final_rounds

    assert load_final_rounds(shards).sum() == 8  # each of the 8 requests ends in exactly one round
    p = subprocess.run([sys.executable, "-m", "training.calibrate_sts", str(rec), "--dataset", "test",
                        "--out", str(tmp_path / "sts.json")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    from dspark_jax.calibration.sts import StsCalibration

    assert StsCalibration.load(tmp_path / "sts.json", block_size=drafter.config.block_size).block_size == 4
    with pytest.raises(ValueError, match="compact"):
        dspark(pair, EngineConfig(**EC, precompile=False), mode="compact", record_sts_dir=str(rec))


@pytest.mark.parametrize("split", [True, False], ids=["large-layers-split", "small-layers-stacked"])
def test_gpu_execution_options_commit_the_same_tokens(pair, plain, model_dir, split, monkeypatch):
    """What the engines run on the GPU -- every loop unrolled (target layers, drafter layers, the
    gamma sampling steps, the context extension; the MTP chain) and the Pallas kernels
    (interpret mode here) -- commits exactly the plain engine's greedy tokens, for DSpark and MTP,
    over layer weights split into one array per layer (as large models are) or left stacked."""
    from dspark_jax.layers import layer_split
    from dspark_jax.spec.mtp.model import MTPConfig, MTPDrafter

    if split:  # as if these small layers were large
        monkeypatch.setattr(layer_split, "SPLIT_MIN_LAYER_BYTES", 0)
    # copies: an unrolling engine splits its models' layer weights in place (layers/layer_split.py)
    target, tok, drafter = pair
    target, drafter = nnx.clone(target), nnx.clone(drafter)
    gpu_like = EngineConfig(**EC, unroll_decode=True, kernels="pallas", precompile=False)
    prompts = _prompts(target.config.vocab_size, 5, seed=11)
    want = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    eng = dspark((target, tok, drafter), gpu_like, mode="compact", cost_table=TABLE)
    runner = eng.runner
    assert runner.unroll and (runner.backend, runner.norm_backend, runner.kv_write_backend) == ("pallas",) * 3
    assert is_split(target.layers) == is_split(drafter.layers) == runner.split == split
    assert not is_split(pair[0].layers)
    assert [r.token_ids for r in eng.generate(prompts, GREEDY)] == want
    assert np.asarray(eng.stats["accept_lens"]).max() >= 3
    mtp = Engine(target, tok, gpu_like, drafter=MTPDrafter(MTPConfig.from_target(target.config), rngs=nnx.Rngs(1)),
                 spec=SpeculativeConfig(algorithm="mtp", num_steps=3))
    assert [r.token_ids for r in mtp.generate(prompts, GREEDY)] == want


def test_rounds_become_plain_decode_steps_where_speculation_is_priced_to_lose(pair, plain):
    """A table whose plain decode step is cheaper than any speculative round: every round is a
    decode step (nothing drafted, one token a request, the decode executables), and the output
    equals the plain engine's token for token, greedy and sampled alike (the same sampling keys).
    A table whose decode step is dear keeps speculating, and mixed batches stay lossless."""
    target, _, drafter = pair
    prompts = _prompts(target.config.vocab_size, 6, seed=17)
    sampled = [SamplingParams(max_new_tokens=20, temperature=0.9, top_k=40, seed=50 + i, ignore_eos=True)
               for i in range(6)]
    cheap = dspark(pair, EngineConfig(**EC), mode="compact", cost_table=TABLE.with_decode([1, 4], [1e-5, 2e-5]))
    assert {k[1] for k in cheap.worker._compiled if k[0] == "round"} >= {"decode"}
    for params in (GREEDY, sampled):
        assert [r.token_ids for r in cheap.generate(prompts, params)] == \
            [r.token_ids for r in plain.generate(prompts, params)]
    assert set(cheap.stats["accept_lens"]) == {1} and set(cheap.stats["verify_lens"]) == {1}
    assert all(k == 0 for _, k, *_ in cheap.stats["round_log"]) and not cheap.worker.scheduler._ring
    dear = dspark(pair, mode="compact", cost_table=TABLE.with_decode([1, 4], [1.0, 1.0]))
    got = dear.generate(prompts, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain.generate(prompts, GREEDY)]
    assert max(dear.stats["accept_lens"]) > 1


def test_a_derived_cost_table_is_profiled_once_and_read_back(pair, plain, tmp_path, monkeypatch):
    """cost_table "derive": the engine times rounds in its own loop (every batch bucket at three
    budgets, and a decode round each), schedules with the fit, and caches it: a second engine
    reads the same table without timing anything.  The profile leaves no trace in the
    statistics, and a lazily compiled engine profiles before its first request runs, that
    request's output still plain greedy."""
    import dspark_jax.spec.dspark.profile as profile

    monkeypatch.setattr(profile, "derive_cost_table",
                        lambda worker, cache_dir=None, measure=True, real=profile.derive_cost_table:
                        real(worker, tmp_path, measure))
    cells = []
    monkeypatch.setattr(profile, "profile_cells", lambda *a, real=profile.profile_cells, **k: cells.extend(real(*a, **k))
                        or cells)
    eng = dspark(pair, EngineConfig(**EC), mode="compact", cost_table="derive")
    table = eng.worker.scheduler.cost_table
    G, buckets = eng.worker.gamma, eng.decode_buckets
    assert table is not None and table.prices_decode and table.decode_bs_probes.tolist() == buckets
    key = lambda c: (c[0], -1 if c[1] is None else c[1])
    assert sorted(((c["bs"], c["K"]) for c in cells), key=key) == sorted(
        [(b, int(round(f * b * G))) for b in buckets for f in profile.DEFAULT_FRACTIONS] + [(b, None) for b in buckets],
        key=key)
    assert all(c["seconds"] > 0 for c in cells) and list(tmp_path.glob("*.json"))
    assert eng.stats["rounds"] == 0 and not eng.stats["round_log"] and not eng.has_unfinished()
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages
    prompts = _prompts(pair[0].config.vocab_size, 4, seed=3)
    assert [r.token_ids for r in eng.generate(prompts, GREEDY)] == [r.token_ids for r in plain.generate(prompts, GREEDY)]
    cells.clear()
    again = dspark(pair, EngineConfig(**EC), mode="compact", cost_table="derive")
    assert not cells and again.worker.scheduler.cost_table.to_dict() == table.to_dict()
    lazy = dspark(pair, mode="compact", cost_table="derive")  # reads the cached table on its first step
    assert lazy.worker.needs_calibration
    assert [r.token_ids for r in lazy.generate(prompts, GREEDY)] == [r.token_ids for r in plain.generate(prompts, GREEDY)]
    assert not lazy.worker.needs_calibration and lazy.worker.scheduler.cost_table.to_dict() == table.to_dict()


def test_a_cost_profile_that_cannot_fit_the_kv_pool_says_so(pair):
    """The profile runs every batch bucket's requests at once; a pool too small for the largest
    batch to grow through its cells is a clear start-up error, not a loop waiting for pages."""
    with pytest.raises(ValueError, match="cost profile of 4 requests"):
        dspark(pair, EngineConfig(**EC, num_pages=40), mode="compact", cost_table="derive")


def test_speculation_pays_is_the_best_full_acceptance_round_against_a_decode_step(pair):
    """On TABLE: a round of bs requests with every draft accepted commits bs + K tokens in
    T(bs, K); speculation pays at bs when the best of those beats bs / T_decode(bs) by the min-gain
    factor.  A 1 us decode step wins at every bucket, a 1 s one loses; with decode steps nearly
    free from batch 2 up, batch 1 decides, on either side of its threshold.  Only a derived table
    may rule speculation out."""
    eng = dspark(pair, mode="compact", cost_table="derive")
    worker = eng.worker
    for decode, pays in ((1e-6, False), (1.0, True)):
        worker.use_table(TABLE.with_decode([1, 4], [decode, decode]))
        assert worker.speculation_pays() is pays
    G = worker.gamma
    best1 = max((1 + K) / TABLE.predict(1, K) for K in range(G + 1))
    threshold = 1.04 / best1  # the batch-1 decode time at which a full-acceptance round just pays
    for scale, pays in ((0.999, False), (1.001, True)):
        worker.use_table(TABLE.with_decode([1, 4], [scale * threshold, 1e-9]))
        assert worker.speculation_pays() is pays
    given = dspark(pair, mode="compact", cost_table=TABLE.with_decode([1, 4], [1e-6, 1e-6]))
    assert given.worker.speculation_pays()


def test_an_engine_whose_measured_table_rules_speculation_out_runs_plain_steps(pair, plain, tmp_path, monkeypatch):
    """A derived table in which no round beats a decode step at any batch size: the engine drops
    the drafter (its cache and weights released) and runs plain decode steps, token for token the
    plain engine's, greedy and seeded sampling alike.  A table in which speculation pays somewhere
    keeps the DSpark worker."""
    import dspark_jax.spec.dspark.profile as profile
    from dspark_jax.engine.worker import PlainWorker

    def fake_cells(decode_seconds):
        def cells(engine, batch_sizes, fractions=profile.DEFAULT_FRACTIONS, **_):
            G = engine.worker.gamma
            return [{"bs": b, "K": int(round(f * b * G)), "M": b + int(round(f * b * G)), "tier": 0,
                     "seconds": 1e-2 + 1e-4 * b * f} for b in batch_sizes for f in fractions] + \
                [{"bs": b, "K": None, "M": b, "tier": b, "seconds": decode_seconds} for b in batch_sizes]
        return cells

    derive = profile.derive_cost_table
    prompts = _prompts(pair[0].config.vocab_size, 4, seed=21)
    sampled = [SamplingParams(max_new_tokens=12, temperature=0.8, seed=70 + i, ignore_eos=True) for i in range(4)]
    for decode_seconds, speculates in ((1e-6, False), (1.0, True)):
        monkeypatch.setattr(profile, "profile_cells", fake_cells(decode_seconds))
        eng = Engine(*pair[:2], EngineConfig(**LAZY), drafter=pair[2],
                     spec=SpeculativeConfig(mode="compact", cost_table="derive"))
        monkeypatch.setattr(profile, "derive_cost_table",
                            lambda worker, cache_dir=None, measure=True, d=tmp_path / str(decode_seconds):
                            derive(worker, d, measure))
        worker = eng.worker
        got = [r.token_ids for r in eng.generate(prompts, GREEDY)]
        assert got == [r.token_ids for r in plain.generate(prompts, GREEDY)]
        assert isinstance(eng.worker, PlainWorker) is not speculates
        if not speculates:
            assert worker.dcache is None and worker.drafter_state is None
            assert [r.token_ids for r in eng.generate(prompts, sampled)] == \
                [r.token_ids for r in plain.generate(prompts, sampled)]
        # A precompiled engine started on that cache decides before it compiles: where the cached
        # table rules speculation out, it never builds a speculative executable.
        monkeypatch.setattr(profile, "profile_cells", lambda *a, **k: pytest.fail("the cached table was profiled again"))
        built = []
        monkeypatch.setattr(engine_module, "compile_engines",
                            lambda engines, progress=None, built=built, **_:
                            built.extend(x for e in engines for x, _ in e.executables()) or 0.0)
        warm = Engine(*pair[:2], EngineConfig(**EC), drafter=pair[2],
                      spec=SpeculativeConfig(mode="compact", cost_table="derive"))
        assert isinstance(warm.worker, PlainWorker) is not speculates
        assert built and any(label.startswith("dspark") for label in built) is speculates
