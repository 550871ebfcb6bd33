"""Block-accept estimator: hand-computed walks, lifecycle rules, and a simulated check that its
[lo, hi] interval brackets the uncensored ceiling that full-block verification would deliver."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dspark_jax.spec.dspark.block_accept import BlockAcceptEstimator

LN = math.log


def _round(est, rid, start, w, acc, drafts, q, committed, *, probes=None, next_p=None, eligible=True,
           full=False):
    """One request's round.  q: draft probabilities of `drafts`; probes {(row, slot): target p};
    next_p: target p of d_{w+1} at row w (None when w == gamma)."""
    G = est.gamma
    probe_logp = np.full((1, G + 1, est.max_pending), np.nan)
    for (j, p), v in (probes or {}).items():
        probe_logp[0, j, p] = LN(v)
    est.update([rid], [start], [w], [acc], [drafts], [np.log(q)], probe_logp,
               [np.nan if next_p is None else LN(next_p)], [np.asarray(committed)], [eligible], full)


def _outcomes(est):
    return [(o.start, o.lo, o.hi, o.reason) for o in est.drain_outcomes()]


def test_untrimmed_row_is_exact():
    est = BlockAcceptEstimator(4, keep_outcomes=True)
    _round(est, "r", 10, 3, 1, [5, 6, 7, 8], [0.5] * 4, [5, 9], next_p=0.3)
    assert _outcomes(est) == [(10, 2.0, 2.0, "untrimmed")]
    s = est.summary()
    assert (s["rows"], s["lo_mean"], s["hi_mean"], s["mid_mean"], s["pending"]) == (1, 2.0, 2.0, 2.0, 0)
    assert s["window"] == {"rows": 1, "lo_mean": 2.0, "hi_mean": 2.0, "mid_mean": 2.0}


def test_trimmed_walk_accepts_then_diverges():
    est = BlockAcceptEstimator(4, keep_outcomes=True)
    # Anchor at 10, w = 1, d_1 accepted; bonus 8 at position 12 equals d_2, whose target p at the
    # last verified row is 0.25 against q 0.5: a_2 = 0.5, prod 0.5, lo_extra 0.5.
    _round(est, 1, 10, 1, 1, [7, 8, 9, 5], [0.5, 0.5, 0.8, 0.4], [7, 8], next_p=0.25)
    assert _outcomes(est) == [] and est.summary()["pending"] == 1
    # Next round anchors at 12: rows 0, 1 ask for d_3 = 9 (position 13) and d_4 = 5 (position 14).
    probes = est.probe_tokens([1], [12], 5)
    assert probes.shape == (1, 5, 4)
    np.testing.assert_array_equal(probes[0, :, 0], [9, 5, -1, -1, -1])
    assert (probes[0, :, 1:] == -1).all()
    assert (est.probe_tokens([1], [13], 5) == -1).all()  # a start that does not continue: no probes
    # The round rejects its first draft and realises 3 at position 13: a_3 = min(1, 0.4 / 0.8) = 0.5,
    # prod 0.25, lo_extra 0.75, then divergence with one tail token (d_4) unwalked.
    _round(est, 1, 12, 2, 0, [3, 1, 2, 0], [0.5] * 4, [3], probes={(0, 0): 0.4}, next_p=0.2)
    lo = 1 + 1 + 0.75
    assert _outcomes(est) == [(10, lo, lo + 0.25 * 1, "diverged"), (12, 1.0, 1.0, "untrimmed")]
    s = est.summary()
    assert s["rows"] == 2 and s["pending"] == 0
    assert s["lo_mean"] == pytest.approx((lo + 1) / 2)
    assert s["hi_mean"] == pytest.approx((lo + 0.25 + 1) / 2)
    assert s["mid_mean"] == pytest.approx((lo + 0.125 + 1) / 2)


def _open_block(est, rid="r"):
    """gamma 4, anchor 0, w = 2 accepted, bonus 3 == d_3 with a_3 = 0.2 / 0.5: prod 0.4, lo 3.4."""
    _round(est, rid, 0, 2, 2, [1, 2, 3, 4], [0.5] * 4, [1, 2, 3], next_p=0.2)


def test_finish_at_eos_closes_the_interval():
    est = BlockAcceptEstimator(4, keep_outcomes=True)
    _open_block(est)
    assert est.request_summary("r")["pending"] == 1
    summary = est.finish("r", "eos")
    assert _outcomes(est) == [(0, pytest.approx(3.4), pytest.approx(3.4), "eos")]
    assert summary["rows"] == 1 and summary["lo_mean"] == pytest.approx(3.4)
    assert est.request_summary("r")["rows"] == 0  # forgotten


@pytest.mark.parametrize("reason", ["length", "abort"])
def test_truncation_keeps_the_unresolved_tail_open(reason):
    est = BlockAcceptEstimator(4, keep_outcomes=True)
    _open_block(est)
    est.finish("r", reason)
    # d_4 never scored: hi = lo + prod * 1.
    assert _outcomes(est) == [(0, pytest.approx(3.4), pytest.approx(3.8), reason)]
    with pytest.raises(ValueError):
        est.finish("r", "timeout")


def test_tail_walked_through_is_exact():
    est = BlockAcceptEstimator(2, keep_outcomes=True)
    # gamma 2, w = 1: the only trimmed token d_2 is scored and realised in the creating round.
    _round(est, "r", 0, 1, 1, [4, 6], [0.5, 0.25], [4, 6], next_p=0.5)
    assert _outcomes(est) == [(0, 3.0, 3.0, "complete")]  # a_2 = 1


def test_walk_spans_two_later_rounds_with_overlapping_blocks():
    G = 6
    est = BlockAcceptEstimator(G, keep_outcomes=True)
    q = [0.5] * G
    # Round 1 (anchor 0, w = 1): block A, tail [11..15] at positions 2..6.  Bonus 11 matches and
    # a_2 = 1: prod 1, lo_extra 1.
    _round(est, "r", 0, 1, 1, [10, 11, 12, 13, 14, 15], q, [10, 11], next_p=0.5)
    np.testing.assert_array_equal(est.probe_tokens(["r"], [2], G + 1)[0, :, 0], [12, 13, 14, 15, -1, -1, -1])
    # Round 2 (anchor 2, w = 1): realises 12, 13 at positions 3, 4, both A's tokens:
    # A: a = 0.5 (prod 0.5, lo_extra 1.5), a = 1 (prod 0.5, lo_extra 2.0).
    # The round is itself censored: block B, tail [13, 30, 31, 32, 33] at positions 4..8; its
    # first token is realised (13): a = 0.1 / 0.5 = 0.2, prod 0.2, lo_extra 0.2.
    _round(est, "r", 2, 1, 1, [12, 13, 30, 31, 32, 33], q, [12, 13], probes={(0, 0): 0.25, (1, 0): 0.5},
           next_p=0.1)
    assert _outcomes(est) == [] and est.summary()["pending"] == 2
    probes = est.probe_tokens(["r"], [4], G + 1)[0]
    np.testing.assert_array_equal(probes[:, 0], [14, 15, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(probes[:, 1], [30, 31, 32, 33, -1, -1, -1])
    # Round 3 (anchor 4, w = 3, two accepted, residual bonus 50): realises 14, 15, 50.
    # A: a = 1 (prod 0.5, lo_extra 2.5), a = 0.2 (prod 0.1, lo_extra 2.6): tail done, lo = hi = 4.6.
    # B: position 5 realises 14, not 30: a = 1 then divergence, 3 tokens left:
    #    lo = 2 + 0.4 = 2.4, hi = 2.4 + 0.2 * 3 = 3.0.
    _round(est, "r", 4, 3, 2, [14, 15, 40, 41, 42, 43], q, [14, 15, 50],
           probes={(0, 0): 0.5, (1, 0): 0.1, (0, 1): 0.9}, next_p=0.3)
    got = _outcomes(est)
    assert [o[3] for o in got] == ["complete", "diverged", "untrimmed"]
    np.testing.assert_allclose([o[1:3] for o in got], [(4.6, 4.6), (2.4, 3.0), (3.0, 3.0)])
    s = est.summary()
    assert s["lo_mean"] == pytest.approx(10.0 / 3) and s["hi_mean"] == pytest.approx(10.6 / 3)


def test_ineligible_rows_are_not_counted():
    est = BlockAcceptEstimator(4, keep_outcomes=True)
    _round(est, "g", 0, 2, 2, [1, 2, 3, 4], [0.5] * 4, [1, 2, 3], next_p=0.2, eligible=False)
    _round(est, "g", 3, 1, 0, [1, 2, 3, 4], [0.5] * 4, [9], eligible=False)
    assert est.summary()["rows"] == 0 and est.summary()["pending"] == 0
    assert (est.probe_tokens(["g"], [4], 5) == -1).all()
    # A pending block whose request turns ineligible is closed as truncated.
    _open_block(est, "t")
    _round(est, "t", 3, 1, 0, [1, 2, 3, 4], [0.5] * 4, [9], eligible=False)
    assert _outcomes(est) == [(0, pytest.approx(3.4), pytest.approx(3.8), "ineligible")]


def test_reused_request_id_resets_state():
    est = BlockAcceptEstimator(4, keep_outcomes=True)
    _round(est, 5, 0, 2, 0, [1, 2, 3, 4], [0.5] * 4, [7])
    assert est.finish(5, "eos")["rows"] == 1
    _round(est, 5, 100, 3, 1, [1, 2, 3, 4], [0.5] * 4, [1, 9])
    assert est.request_summary(5)["rows"] == 1 and est.request_summary(5)["lo_mean"] == 2.0
    assert est.summary()["rows"] == 2
    # Reuse without finish (e.g. ids that are slots): a start that does not continue the request
    # closes its pending blocks as truncated and starts fresh per-request statistics.
    _open_block(est, 6)
    _round(est, 6, 50, 3, 0, [1, 2, 3, 4], [0.5] * 4, [8])
    assert _outcomes(est)[-2:] == [(0, pytest.approx(3.4), pytest.approx(3.8), "discontinuity"),
                                   (50, 1.0, 1.0, "untrimmed")]
    assert est.request_summary(6)["rows"] == 1 and est.request_summary(6)["lo_mean"] == 1.0


def test_full_block_rounds_are_exact_and_never_open_blocks():
    est = BlockAcceptEstimator(4, keep_outcomes=True)
    _round(est, "r", 0, 4, 4, [1, 2, 3, 4], [0.5] * 4, [1, 2, 3, 4, 5])
    # gamma_full (cap-accept): accepted is the full-block count, nothing is censored.
    _round(est, "r", 5, 2, 2, [1, 2, 3, 4], [0.5] * 4, [1, 2, 3], next_p=0.1, full=True)
    assert _outcomes(est) == [(0, 5.0, 5.0, "full"), (5, 3.0, 3.0, "full")]
    assert est.summary()["pending"] == 0


def test_window_and_validation():
    est = BlockAcceptEstimator(4, window=2)
    for start, acc in ((0, 0), (1, 1), (3, 2)):
        _round(est, "r", start, 3, acc, [1, 2, 3, 4], [0.5] * 4, [1, 2, 3][:acc] + [9])
    s = est.summary()
    assert s["lo_mean"] == pytest.approx(2.0) and s["window"]["rows"] == 2
    assert s["window"]["lo_mean"] == pytest.approx(2.5)
    with pytest.raises(ValueError):  # accepted > window
        _round(est, "r", 6, 1, 2, [1, 2, 3, 4], [0.5] * 4, [1, 2, 3])
    # A pending probe whose log p is missing is an integration error, not a silent skip.
    _open_block(est, "m")
    with pytest.raises(ValueError, match="missing target log p"):
        _round(est, "m", 3, 2, 0, [1, 2, 3, 4], [0.5] * 4, [4])


# -- statistical check against full-block speculative sampling -----------------------------------


def _sample(rng, probs):
    """One draw per row of probs [B, V] (inverse CDF)."""
    cdf = np.cumsum(probs, -1)
    return np.minimum((rng.random(len(probs))[:, None] * cdf[:, -1:] > cdf).sum(-1), probs.shape[1] - 1)


def _simulate(seed=1234, V=6, G=5, B=64, rounds=500):
    """Markov-chain target P and draft Q (next token depends on the previous one, so a probe is
    only right on the realised prefix).  Each round drafts a block from Q, draws the uniforms of
    full-block speculative sampling, and runs compact on the same draws with a random window:
    accepted = min(full-block count, w), bonus from the residual after a rejection, else from P
    after d_w.  Returns per counted row (truth = full-block ceiling, cond = E[truth | drafts],
    compact = accepted + 1, censored, lo, hi) and the estimator."""
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.full(V, 0.05), size=V) + 1e-4  # peaked, like an LLM's, with full support
    P /= P.sum(-1, keepdims=True)
    Q = 0.8 * P + 0.2 * rng.dirichlet(np.ones(V), size=V)
    est = BlockAcceptEstimator(G, keep_outcomes=True)
    ids, rows = np.arange(B), np.arange(B)
    eligible = ids % 8 != 0
    start, last = rng.integers(0, 50, B), rng.integers(0, V, B)
    left = rng.integers(10, 80, B)
    truth, out = {}, []

    def drain():
        for o in est.drain_outcomes():
            assert eligible[o.request_id]
            out.append((*truth.pop((o.request_id, o.start)), o.lo, o.hi))

    for _ in range(rounds):
        probes = est.probe_tokens(ids, start, G + 1)
        inputs = np.zeros((B, G + 1), np.int64)
        inputs[:, 0] = last
        for k in range(G):
            inputs[:, k + 1] = _sample(rng, Q[inputs[:, k]])
        drafts, prev = inputs[:, 1:], inputs[:, :-1]
        ratio = np.minimum(1.0, P[prev, drafts] / Q[prev, drafts])
        full = np.cumprod(rng.random((B, G)) < ratio, 1).sum(1)
        w = rng.integers(0, G + 1, B)
        acc = np.minimum(full, w)
        at = inputs[rows, acc]
        resid = np.maximum(P[at] - Q[at], 0.0)
        use_resid = (acc < w)[:, None] & (resid.sum(-1, keepdims=True) > 1e-12)
        bonus = _sample(rng, np.where(use_resid, resid, P[at]))
        committed = [np.append(drafts[i, :acc[i]], bonus[i]) for i in range(B)]
        probe_logp = np.where(probes >= 0, np.log(P[inputs[:, :, None], np.maximum(probes, 0)]), np.nan)
        wc = np.minimum(w, G - 1)
        next_logp = np.where(w < G, np.log(P[inputs[rows, wc], drafts[rows, wc]]), np.nan)
        est.update(ids, start, w, acc, drafts, np.log(Q[prev, drafts]), probe_logp, next_logp, committed,
                   eligible)
        for i in np.flatnonzero(eligible):
            tail = np.cumprod(ratio[i, w[i]:]).sum() if acc[i] == w[i] else 0.0
            censored = acc[i] == w[i] < G
            truth[(i, int(start[i]))] = (full[i] + 1, acc[i] + 1 + tail, acc[i] + 1, censored)
        drain()
        start, last, left = start + acc + 1, bonus, left - acc - 1
        for i in np.flatnonzero(left <= 0):  # token limit: finish, reuse the id for a new request
            est.finish(int(i), "length")
            drain()
            start[i], last[i], left[i] = rng.integers(0, 50), rng.integers(0, V), rng.integers(10, 80)
    for i in ids:
        est.finish(int(i), "length")
    drain()
    assert not truth  # every eligible row counted exactly once
    return np.array(out, float), est


def test_interval_brackets_the_full_block_ceiling():
    res, est = _simulate()
    truth, cond, compact, censored, lo, hi = res.T
    censored = censored.astype(bool)
    n = len(res)
    assert n > 25000
    # Exact, per row: lo <= E[ceiling | drafts] <= hi (brute-force sum over the whole tail).  This
    # holds by construction, not just on average.  Uncensored rows are observed exactly.
    assert np.all(lo <= cond + 1e-9) and np.all(cond <= hi + 1e-9)
    for x in (lo, hi, truth):
        np.testing.assert_array_equal(x[~censored], compact[~censored])
    assert np.all(lo[censored] >= compact[censored] + 1e-12)  # a_{w+1} > 0 always adds something
    # On average: the mean full-block ceiling lies in [mean lo, mean hi].  mid is not asserted to
    # match: every unresolved tail term lies anywhere in [0, prod] and mid takes prod / 2, which
    # has no reason to be right; lo and hi are the guaranteed bounds.  Tolerance: 4 standard errors
    # of the paired per-row difference (rows are independent given the seed; ceilings are bounded
    # by gamma + 1, so the CLT applies at n > 25000); with the fixed seed the test is deterministic.
    se = lambda x: x.std(ddof=1) / math.sqrt(n)
    assert (truth - lo).mean() >= -4 * se(truth - lo)
    assert (hi - truth).mean() >= -4 * se(hi - truth)
    # The simulation itself is sound: E[truth | drafts] averages to the realised ceilings.
    assert abs((truth - cond).mean()) <= 4 * se(truth - cond)
    # ...and the estimator matters: censoring drags the naive compact mean far below the truth; lo
    # recovers most of that gap and the interval is narrower than it.  How much depends on how
    # often the realised tokens keep matching the trimmed ones: with this seed lo ~ truth - 0.29,
    # hi ~ truth + 0.11 against a gap of ~1.35; over seeds 0-5 lo recovered 64-94% of the gap and
    # the width was 8-49% of it, hence the loose thresholds.
    gap = (truth - compact).mean()
    assert gap > 20 * se(truth - compact)
    assert (lo - compact).mean() > 0.5 * gap
    assert (hi - lo).mean() < 0.6 * gap
    assert 0.2 < censored.mean() < 0.8  # a real share of rows was censored
    s = est.summary()
    assert s["rows"] == n and s["pending"] == 0
    assert s["lo_mean"] == pytest.approx(lo.mean()) and s["hi_mean"] == pytest.approx(hi.mean())
