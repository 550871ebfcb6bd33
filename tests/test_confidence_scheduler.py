"""Confidence scheduler: prefix-shaped top-K, tie-break, global budget argmax, lag ring, guard."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.spec.dspark.cost_model import AdditiveCostTable
from dspark_jax.spec.dspark.scheduler import SURVIVAL_EPS, ConfidenceScheduler

GAMMA = 7
W = GAMMA + 1


def _random_survival(rng, rows, gamma=GAMMA, quantised=False):
    if quantised:  # many exact ties, and zeros
        conf = rng.choice([1.0, 1.0, 0.5, 0.25, 0.0], size=(rows, gamma))
    else:
        conf = rng.uniform(0.0, 1.0, size=(rows, gamma)) ** 0.3
    return np.cumprod(conf, axis=1)


def _reference_lens(s, k):
    """Independent top-K: rank by (survival desc, position asc, request asc) with lexsort."""
    rows, gamma = s.shape
    r, j = np.meshgrid(np.arange(rows), np.arange(gamma), indexing="ij")
    order = np.lexsort((r.ravel(), j.ravel(), -s.ravel()))  # last key is primary
    counts = np.zeros(rows, int)
    for idx in order[:k]:
        counts[r.ravel()[idx]] += 1
    return 1 + counts


# -- role 2: verify lengths -----------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_topk_selection_is_a_prefix_and_matches_reference(seed):
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 40))
    s = _random_survival(rng, rows, quantised=seed % 2 == 1)
    if seed % 4 == 2:
        s = s.astype(np.float32)
    sched = ConfidenceScheduler(GAMMA, None)
    for k in sorted({0, 1, rows, int(rng.integers(0, rows * GAMMA + 1)), rows * GAMMA, rows * GAMMA + 5}):
        lens = sched.verify_lens(s, k)
        assert lens.dtype == np.int32 and lens.shape == (rows,)
        assert np.all((1 <= lens) & (lens <= W))
        assert int(np.sum(lens - 1)) == min(k, rows * GAMMA)
        np.testing.assert_array_equal(lens, _reference_lens(s, k))
        # Prefix: every chosen position's survival is >= every unchosen one's in the same row,
        # and the chosen set is exactly positions 0..lens-2 (implied by counting, checked anyway).
        for r in range(rows):
            chosen, rest = s[r, : lens[r] - 1], s[r, lens[r] - 1:]
            assert chosen.size == 0 or rest.size == 0 or chosen.min() >= rest.max()


def test_tie_break_is_position_then_request():
    sched = ConfidenceScheduler(GAMMA, None)
    ones = np.ones((5, GAMMA))
    assert sched.verify_lens(ones, 3).tolist() == [2, 2, 2, 1, 1]  # position 0 of requests 0,1,2
    assert sched.verify_lens(ones, 5 + 2).tolist() == [3, 3, 2, 2, 2]  # all of position 0, then position 1
    assert sched.verify_lens(ones, 5 * 3 + 4).tolist() == [5, 5, 5, 5, 4]
    # A mixed tie: request 1's position 0 equals request 0's position 1; position wins.
    s = np.array([[0.9, 0.6, 0.1], [0.6, 0.6, 0.0]])
    assert ConfidenceScheduler(3, None).verify_lens(s, 2).tolist() == [2, 2]
    assert ConfidenceScheduler(3, None).verify_lens(s, 3).tolist() == [3, 2]


@pytest.mark.parametrize("seed", range(10))
def test_verify_decision_for_a_draft_ignores_later_positions_of_its_row(seed):
    """The stopping-rule property behind losslessness: whether (r, j) is verified depends on
    s[r, :j+1] and other rows, never on s[r, j+1:] (which depends on draft x[r, j])."""
    rng = np.random.default_rng(100 + seed)
    rows = 12
    s = _random_survival(rng, rows, quantised=seed % 2 == 0)
    sched = ConfidenceScheduler(GAMMA, None)
    r, j = int(rng.integers(rows)), int(rng.integers(GAMMA - 1))
    changed = s.copy()
    changed[r, j + 1:] = s[r, j] * np.cumprod(rng.uniform(0, 1, GAMMA - j - 1))
    for k in range(rows * GAMMA + 1):
        a, b = sched.verify_lens(s, k)[r] - 1, sched.verify_lens(changed, k)[r] - 1
        assert min(a, j + 1) == min(b, j + 1)


def test_verify_lens_rejects_bad_survival():
    sched = ConfidenceScheduler(3, None)
    with pytest.raises(ValueError, match="non-increasing"):
        sched.verify_lens(np.array([[0.9, 0.95, 0.1]]), 2)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sched.verify_lens(np.array([[1.5, 0.5, 0.1]]), 2)
    with pytest.raises(ValueError, match="finite"):
        sched.verify_lens(np.array([[np.nan, 0.5, 0.1]]), 2)
    with pytest.raises(ValueError, match="shape"):
        sched.verify_lens(np.ones((2, 4)), 2)
    with pytest.raises(ValueError, match="budget"):
        sched.verify_lens(np.ones((2, 3)), -1)
    assert sched.verify_lens(np.ones((0, 3)), 4).shape == (0,)


# -- role 1: the budget ---------------------------------------------------------------------


def _interp(x, xs, ys):
    """Plain-Python clamped piecewise-linear interpolation (independent of np.interp)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            return ys[i - 1] + (x - xs[i - 1]) * (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
    raise AssertionError


def _brute_force(table_args, survival, fresh):
    bias, bsp, alpha, mp, theta = table_args
    rows = len(survival)
    cands = []
    for r in range(rows):
        for j in range(len(survival[r])):
            v = 1.0 if fresh[r] else float(survival[r][j])
            if v >= SURVIVAL_EPS:
                cands.append(v)
    cands.sort(reverse=True)
    best_n, best, values = 0, None, []
    for n in range(len(cands) + 1):
        tau = rows + sum(cands[:n])
        t = bias + _interp(rows, bsp, alpha) + _interp(rows + n, mp, theta)
        values.append(tau / t)
        if best is None or tau / t > best:
            best, best_n = tau / t, n
    return best_n, values


def _staircase(tiers, risers, bias=1e-3):
    """theta flat on (tier_{i-1}, tier_i], rising by risers[i] right after tier_i."""
    mp, theta, level = [], [], 0.0
    for t, rise in zip(tiers, risers):
        mp += [t, t + 1]
        theta += [level, level + rise]
        level += rise
    return (bias, [1.0, 256.0], [0.0, 0.0], mp[:-1], theta[:-1])


def test_budget_stops_right_before_a_riser_and_is_global_not_first_local_max():
    rows = 4
    args = _staircase(tiers=[8, 16, 24, 32], risers=[2e-4, 8e-4, 2e-4, 0.0])
    table = AdditiveCostTable(*args)
    survival = np.tile([0.97, 0.95, 0.93, 0.2, 0.1, 0.05, 0.02], (rows, 1))
    fresh = np.zeros(rows, bool)
    expected, values = _brute_force(args, survival.tolist(), fresh)
    decision = ConfidenceScheduler(GAMMA, table).decide_budget(survival, fresh)
    assert decision.budget == expected == 12  # M = 4 + 12 = 16: the last token before the riser at 17
    # Not unimodal: a local maximum at n = 4 (M = 8), a dip, then the global one at n = 12.
    assert values[4] > values[5] and values[12] > values[4]
    first_local_max = next(n for n in range(len(values) - 1) if values[n + 1] < values[n])
    assert first_local_max == 4 != decision.budget
    assert decision.expected_tokens == pytest.approx(rows + 4 * (0.97 + 0.95 + 0.93))
    assert decision.predicted_step_seconds == pytest.approx(1e-3 + 2e-4)


@pytest.mark.parametrize("seed", range(25))
def test_budget_equals_brute_force_argmax_on_random_staircases(seed):
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 24))
    tiers = np.unique(rng.integers(1, rows * W + 8, size=6))
    tiers = [int(x) for i, x in enumerate(tiers) if i == 0 or x - tiers[i - 1] >= 2]  # probes stay increasing
    args = _staircase(tiers, list(rng.uniform(0, 2e-3, len(tiers))), bias=float(rng.uniform(1e-3, 5e-3)))
    bsp = sorted({float(x) for x in rng.integers(1, 64, 3)})
    args = (args[0], bsp, list(rng.uniform(0, 1e-3, len(bsp))), args[3], args[4])
    table = AdditiveCostTable(*args)
    survival = _random_survival(rng, rows, quantised=seed % 3 == 0)
    fresh = rng.random(rows) < 0.2
    expected, values = _brute_force(args, survival.tolist(), fresh)
    got = ConfidenceScheduler(GAMMA, table).budget(survival, fresh)
    assert got == expected or values[got] == pytest.approx(values[expected], rel=1e-12)


def test_one_scheduler_stays_exact_across_rounds_with_cached_prices():
    """The scheduler caches the table's prices per (batch size, candidates); a long-lived one,
    asked about recurring and changing batch sizes and candidate counts, still returns the
    brute-force argmax every round."""
    rng = np.random.default_rng(99)
    args = _staircase([8, 16, 40, 64], [3e-4, 6e-4, 1e-4, 5e-4], bias=2e-3)
    args = (args[0], [1.0, 8.0], [0.0, 4e-4], args[3], args[4])
    sched = ConfidenceScheduler(GAMMA, AdditiveCostTable(*args))
    for _ in range(40):
        rows = int(rng.choice([3, 5, 8]))
        survival = _random_survival(rng, rows, quantised=False)
        survival[rng.random(rows) < 0.3] *= 1e-7  # rows whose candidates drop below eps
        fresh = rng.random(rows) < 0.2
        expected, values = _brute_force(args, survival.tolist(), fresh)
        got = sched.budget(survival, fresh)
        assert got == expected or values[got] == pytest.approx(values[expected], rel=1e-12)


def test_budget_ties_go_to_the_smaller_budget():
    c = 2.0 ** -10  # theta(M) = c * M exactly, no bias: tau(n) / T(n) = 1 / c for every n
    table = AdditiveCostTable(0.0, [1.0], [0.0], [1.0, 1000.0], [c, 1000 * c])
    decision = ConfidenceScheduler(GAMMA, table).decide_budget(np.ones((3, GAMMA)), np.zeros(3, bool))
    assert decision.budget == 0
    assert decision.predicted_tokens_per_second == 1 / c


def test_fresh_rows_count_as_survival_one_and_eps_drops_candidates():
    table = AdditiveCostTable(1e-3, [1.0], [0.0], [0.0, 100.0], [0.0, 0.0])  # flat: everything is free
    sched = ConfidenceScheduler(GAMMA, table)
    s = np.zeros((3, GAMMA))
    s[0, :2] = [0.5, 1e-7]  # 1e-7 < eps: not a candidate
    d = sched.decide_budget(s, np.array([False, True, False]))
    assert d.num_candidates == 1 + GAMMA
    assert d.budget == 1 + GAMMA  # flat cost: verify every candidate
    assert d.expected_tokens == pytest.approx(3 + 0.5 + GAMMA)


def test_no_table_means_verify_all():
    sched = ConfidenceScheduler(GAMMA, None)
    s = np.full((6, GAMMA), 0.01)
    d = sched.decide_budget(s, np.zeros(6, bool))
    assert d.budget == 6 * GAMMA and d.predicted_step_seconds is None and not d.guard_applied
    assert d.num_candidates == 6 * GAMMA and d.expected_tokens == pytest.approx(6 + 6 * GAMMA * 0.01)
    assert sched.verify_lens(s, d.budget).tolist() == [W] * 6
    rec = sched.plan_step(0, s, np.arange(6))
    assert rec.budget == 6 * GAMMA and rec.verify_lens.tolist() == [W] * 6


def test_min_gain_guard():
    # A nearly flat curve: trimming the weak tail saves a little time.
    table = AdditiveCostTable(5e-3, [1.0], [0.0], [0.0, 64.0], [0.0, 4e-4])
    rows = 8
    s = np.tile([0.9, 0.8, 0.7, 0.01, 0.008, 0.006, 0.004], (rows, 1))
    fresh = np.zeros(rows, bool)
    free = ConfidenceScheduler(GAMMA, table).decide_budget(s, fresh)
    assert free.budget < rows * GAMMA
    full_tput = (rows + s.sum()) / table.predict(rows, rows * GAMMA)
    gain = free.predicted_tokens_per_second / full_tput - 1
    assert 0 < gain < 0.05
    below = ConfidenceScheduler(GAMMA, table, min_predicted_gain=gain / 2).decide_budget(s, fresh)
    assert below.budget == free.budget and not below.guard_applied
    above = ConfidenceScheduler(GAMMA, table, min_predicted_gain=0.05).decide_budget(s, fresh)
    assert above.budget == rows * GAMMA and above.guard_applied
    assert above.predicted_tokens_per_second == pytest.approx(full_tput)
    # Raising the threshold never trims more.
    budgets = [ConfidenceScheduler(GAMMA, table, min_predicted_gain=g).budget(s, fresh)
               for g in (0.0, gain / 4, gain / 2, gain * 2, 0.1, 1.0)]
    assert budgets == sorted(budgets)
    with pytest.raises(ValueError):
        ConfidenceScheduler(GAMMA, table, min_predicted_gain=-0.1)


@pytest.mark.parametrize("seed", range(20))
def test_guarded_budget_equals_brute_force_also_on_nearly_flat_tables(seed):
    """With the min-gain guard on, a table whose prices over every budget differ by less than the
    guard's factor decides verify-all without ranking (a shortcut); whether it takes the shortcut
    or not, the budget is the brute-force argmax overridden by the guard exactly as the rule says."""
    rng = np.random.default_rng(500 + seed)
    rows, g = int(rng.integers(1, 20)), float(rng.choice([0.0, 0.02, 0.04, 0.1]))
    spread = float(rng.choice([0.0, 0.01, 0.03, 0.2]))  # theta's rise over the whole budget range
    bias = float(rng.uniform(5e-4, 2e-3))
    args = (bias, [1.0, 32.0], [0.0, float(rng.uniform(0, 1e-4))], [0.0, 1.0, float(rows * W)],
            [0.0, 0.0, spread * bias])
    survival = _random_survival(rng, rows, quantised=seed % 3 == 0)
    survival[rng.random(rows) < 0.2] *= 1e-7
    fresh = rng.random(rows) < 0.2
    k, values = _brute_force(args, survival.tolist(), fresh)
    table = AdditiveCostTable(*args)
    full = rows * GAMMA
    tau_all = rows + sum(1.0 if fresh[r] else v for r in range(rows) for v in survival[r]
                         if (1.0 if fresh[r] else v) >= SURVIVAL_EPS)
    full_tput = tau_all / table.predict(rows, full)
    expected = full if k != full and values[k] < full_tput * (1 + g) else k
    d = ConfidenceScheduler(GAMMA, table, min_predicted_gain=g).decide_budget(survival, fresh)
    assert d.budget == expected or values[d.budget] == pytest.approx(values[expected], rel=1e-12)
    if d.budget == full:
        assert d.expected_tokens == pytest.approx(tau_all)
        assert d.predicted_step_seconds == pytest.approx(table.predict(rows, full))


@pytest.mark.parametrize("seed", range(10))
def test_a_table_flat_in_k_can_never_trim(seed):
    """A table whose theta is one constant (the engine-loop profile of a host-paced loop) under
    a min-gain guard g > 0: the full ranking decides verify-all on any survival, at any batch size,
    so can_trim is False and verify_all (no survival) returns the same budget and predicted time.
    Without the guard, or with theta rising, it can trim."""
    rng = np.random.default_rng(700 + seed)
    bias, theta = float(rng.uniform(5e-4, 2e-3)), float(rng.uniform(0, 5e-4))
    flat = AdditiveCostTable(bias, [1.0, 8.0, 64.0], [0.0, *rng.uniform(0, 3e-4, 2)], [0.0, 64.0, 512.0],
                             [theta] * 3)
    sched = ConfidenceScheduler(GAMMA, flat, min_predicted_gain=float(rng.choice([0.01, 0.04])))
    assert not sched.can_trim
    for rows in (1, 3, 8, 20, 64):
        survival = _random_survival(rng, rows, quantised=bool(rng.integers(2)))
        survival[rng.random(rows) < 0.2] *= 1e-7  # some candidates under SURVIVAL_EPS
        fresh = rng.random(rows) < 0.2
        ranked = sched.decide_budget(survival, fresh)
        quick = sched.verify_all(rows)
        assert ranked.budget == quick.budget == rows * GAMMA
        assert quick.predicted_step_seconds == pytest.approx(ranked.predicted_step_seconds, rel=1e-12)
        assert quick.predicted_step_seconds == pytest.approx(flat.predict(rows, rows * GAMMA), rel=1e-12)
    for g in (None, 0.0):  # these drop the candidates under SURVIVAL_EPS
        assert ConfidenceScheduler(GAMMA, flat, min_predicted_gain=g).can_trim
    rising = AdditiveCostTable(bias, [1.0], [0.0], [0.0, 512.0], [theta, theta + 1e-6])
    assert ConfidenceScheduler(GAMMA, rising, min_predicted_gain=0.04).can_trim
    assert not ConfidenceScheduler(GAMMA, None).can_trim


@pytest.mark.parametrize("seed", range(20))
def test_plain_decode_steps_where_no_budget_beats_them(seed):
    """With a table that prices a plain decode step, a round is a decode step exactly when the
    best budget's predicted throughput (brute force over every K, guard included) falls below
    R / T_decode(R) x (1 + g); otherwise the speculative decision is unchanged."""
    rng = np.random.default_rng(900 + seed)
    rows = int(rng.integers(1, 40))
    theta = np.sort(rng.uniform(0, 2e-2, 4))
    base = AdditiveCostTable(float(rng.uniform(5e-4, 3e-3)), [1.0, 64.0], [0.0, float(rng.uniform(0, 2e-3))],
                             [0.0, 64.0, 128.0, 512.0], theta - theta[0])
    decode = float(rng.uniform(2e-4, 4e-3))
    table = base.with_decode([1.0, 64.0], [decode, decode * float(rng.uniform(1, 3))])
    g = float(rng.choice([0.0, 0.04]))
    survival = _random_survival(rng, rows, quantised=bool(rng.integers(2))) ** float(rng.uniform(0.5, 4))
    fresh = np.zeros(rows, bool)
    spec = ConfidenceScheduler(GAMMA, base, min_predicted_gain=g).decide_budget(survival, fresh)
    got = ConfidenceScheduler(GAMMA, table, min_predicted_gain=g).decide_budget(survival, fresh)
    plain = rows / table.predict_decode(rows)
    if spec.predicted_tokens_per_second < plain * (1 + g):
        assert got.decode and got.budget == 0 and got.expected_tokens == rows
        assert got.predicted_step_seconds == pytest.approx(table.predict_decode(rows))
    else:
        assert not got.decode and got == spec
    assert ConfidenceScheduler(GAMMA, table).can_decode and not ConfidenceScheduler(GAMMA, base).can_decode


def test_decode_curve_of_a_cost_table():
    t = AdditiveCostTable(1e-3, [1, 4], [0.0, 1e-4], [1, 8], [0.0, 1e-3]).with_decode([1, 8], [2e-4, 6e-4])
    assert t.prices_decode and t.predict_decode(4) == pytest.approx(2e-4 + 3 / 7 * 4e-4)
    assert t.predict_decode(100) == pytest.approx(6e-4)  # clamped past the last probe
    again = AdditiveCostTable.from_dict(t.to_dict())
    assert again.to_dict() == t.to_dict() and "decode_seconds" not in AdditiveCostTable.from_dict(
        {k: v for k, v in t.to_dict().items() if not k.startswith("decode")}).to_dict()
    from dspark_jax.spec.dspark.cost_model import CostTableError

    for bad in ({"decode_seconds": [1e-3]}, {"decode_bs_probes": [1, 2], "decode_seconds": [1e-3, -1.0]},
                {"decode_bs_probes": [2, 1], "decode_seconds": [1e-3, 1e-3]}):
        with pytest.raises(CostTableError, match="decode"):
            AdditiveCostTable.from_dict({**{k: v for k, v in t.to_dict().items() if not k.startswith("decode")},
                                         **bad})


# -- the lag ring ---------------------------------------------------------------------------


def test_fresh_until_lag_steps_are_observed():
    sched = ConfidenceScheduler(GAMMA, None, lag=2)
    gens = np.arange(4)
    s = np.full((4, GAMMA), 0.5)
    assert sched.lagged(0, gens).fresh.all()
    sched.observe(0, s, gens)
    assert sched.lagged(1, gens).fresh.all()  # step -1 was never seen
    sched.observe(1, s * 0.5, gens)
    lag = sched.lagged(2, gens)
    assert not lag.fresh.any()
    np.testing.assert_array_equal(lag.survival, s)  # from step 0, not step 1
    np.testing.assert_array_equal(sched.lagged(3, gens).survival, s * 0.5)
    sched.reset()
    assert sched.lagged(2, gens).fresh.all()
    with pytest.raises(ValueError, match="lag must be >= 1"):
        ConfidenceScheduler(GAMMA, None, lag=0)


def test_recycled_empty_and_unseen_slots_read_fresh():
    sched = ConfidenceScheduler(3, None, lag=1)
    s = np.array([[0.9, 0.5, 0.2], [0.8, 0.4, 0.1], [0.7, 0.3, 0.0]])
    sched.observe(10, s, slot_generation=[5, 6, 7], slots=[0, 2, 3])
    # slot 0 same request; slot 2 recycled (gen 9); slot 3 same; slot 1 never observed;
    # slot 7 past anything observed; slot 4 empty (negative generation).
    lag = sched.lagged(11, slot_generation=[5, 9, 7, 3, 1, -1], slots=[0, 2, 3, 1, 7, 4])
    assert lag.fresh.tolist() == [False, True, False, True, True, True]
    np.testing.assert_array_equal(lag.survival[0], s[0])
    np.testing.assert_array_equal(lag.survival[2], s[2])
    np.testing.assert_array_equal(lag.survival[[1, 3, 4, 5]], 1.0)
    with pytest.raises(ValueError, match="increase"):
        sched.observe(10, s, [5, 6, 7], slots=[0, 2, 3])
    with pytest.raises(ValueError, match="distinct"):
        sched.observe(12, s, [5, 6, 7], slots=[0, 0, 3])


@pytest.mark.parametrize("seed", range(6))
def test_lagged_matches_a_per_slot_dictionary_reference(seed):
    """The ring keeps each step's rows as observed and matches slots when read: whatever the order,
    subset or recycling of the batch, the lagged survival equals a plain per-slot lookup of each
    slot's latest observation at least lag steps old (a hit when its generation is the one asked
    for), and the budget decided from the ring equals decide_budget on that lookup.  Some steps
    observe nothing (plain decode rounds)."""
    rng = np.random.default_rng(seed)
    table = AdditiveCostTable(1e-3, [1.0, 64.0], [0.0, 1e-3], [0.0, 64.0, 512.0], [0.0, 2e-4, 3e-3])
    sched = ConfidenceScheduler(GAMMA, table, lag=2)
    history = {}
    for step in range(10):
        n = int(rng.integers(1, 12))
        slots = rng.permutation(16)[:n]
        gens = rng.integers(-1, 3, size=n)
        s = _random_survival(rng, n).astype(np.float32)
        if step in (4, 5) and seed % 3 == 0:
            history[step] = {}  # nothing observed at this step
        else:
            sched.observe(step, s, gens, slots=slots)
            history[step] = {int(sl): (int(g), s[i]) for i, (sl, g) in enumerate(zip(slots, gens))}
        if step < 2:
            continue
        m = int(rng.integers(1, 12))
        q_slots = slots[:m] if seed % 2 and m <= n else rng.permutation(16)[:m]  # the same batch, or another
        q_gens = rng.integers(-1, 3, size=q_slots.size)
        if seed % 2 and m <= n:
            q_gens = gens[:m]
        lag = sched.lagged(step + 1, q_gens, slots=q_slots)
        seen = {}
        for u in range(step):  # steps up to (step + 1) - lag, the latest per slot winning
            seen.update(history[u])
        for i, (sl, g) in enumerate(zip(q_slots.tolist(), q_gens.tolist())):
            hit = sl in seen and g >= 0 and seen[sl][0] == g
            assert lag.fresh[i] == (not hit)
            np.testing.assert_array_equal(lag.survival[i], seen[sl][1] if hit else 1.0)
        assert sched.decide_lagged(step + 1, q_gens, q_slots) == sched.decide_budget(lag.survival, lag.fresh)


def test_budget_depends_only_on_lagged_data():
    """Changing step t's (and t-1's) survival arbitrarily never changes step t's budget."""
    rng = np.random.default_rng(7)
    table = AdditiveCostTable(2e-3, [1.0, 64.0], [0.0, 1e-3], [0.0, 64.0, 65.0, 128.0, 129.0, 512.0],
                              [0.0, 1e-3, 3e-3, 4e-3, 7e-3, 9e-3])
    rows, steps = 16, 12
    history = [_random_survival(rng, rows) for _ in range(steps)]
    gens = np.arange(rows)
    gens_at = [np.where((gens == 3) & (u >= 6), 100, gens) for u in range(steps)]  # slot 3 recycled at 6
    reference = ConfidenceScheduler(GAMMA, table, lag=2)
    budgets = [reference.plan_step(t, history[t], gens_at[t]).budget for t in range(steps)]
    for t in range(steps):
        sched = ConfidenceScheduler(GAMMA, table, lag=2)
        for u in range(t + 1):
            current = history[u] if u < t - 1 else _random_survival(rng, rows)  # t-1 and t perturbed
            rec = sched.plan_step(u, current, gens_at[u])
        assert rec.budget == budgets[t]
    # Budget at step t equals a direct decision on step t-2's survival (fresh where recycled).
    for t in range(2, steps):
        fresh = gens_at[t] != gens_at[t - 2]
        assert budgets[t] == ConfidenceScheduler(GAMMA, table).budget(history[t - 2], fresh)
    all_fresh = ConfidenceScheduler(GAMMA, table).budget(np.ones((rows, GAMMA)), np.ones(rows, bool))
    assert budgets[0] == budgets[1] == all_fresh
    assert len(set(budgets)) > 1  # the table really trims, by amounts that follow the survival


def test_plan_step_record():
    rng = np.random.default_rng(3)
    table = AdditiveCostTable(5e-3, [1.0, 64.0, 256.0], [0.0, 1e-3, 4e-3], [0.0, 256.0, 512.0, 1024.0, 2048.0],
                              [0.0, 1e-3, 3e-3, 6e-3, 1.2e-2])
    sched = ConfidenceScheduler(GAMMA, table)
    rows = 256
    surv = [_random_survival(rng, rows) for _ in range(4)]
    gens = np.arange(rows)
    for t in range(3):
        rec = sched.plan_step(t, surv[t], gens)
    assert rec.batch_size == rows and 0 <= rec.budget <= rows * GAMMA
    assert int(np.sum(rec.verify_lens - 1)) == rec.budget
    assert rec.predicted_step_seconds == pytest.approx(table.predict(rows, rec.budget))
    # (Its speed at R = 256 is a benchmark's business.)


def test_host_modules_do_not_import_jax():
    import subprocess
    import sys

    code = ("import sys; import dspark_jax.spec.dspark.scheduler, dspark_jax.spec.common.tiers, "
            "dspark_jax.spec.dspark.cost_model; assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
