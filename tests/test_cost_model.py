"""Additive cost table: JSON round-trip, validation, clamped interpolation, least-squares fit."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from dspark_jax.spec.dspark.cost_model import (
    AdditiveCostTable,
    CostTableError,
    fit_additive_cost,
    fit_additive_table,
    load_cost_table,
    m_bin_of,
)


def _table():
    return AdditiveCostTable(
        bias_seconds=0.004,
        bs_probes=[1, 4, 16],
        alpha_seconds=[0.0, 0.0003, 0.0015],
        m_probes=[0, 64, 128],
        theta_seconds=[0.0, 0.001, 0.003],
    )


def test_json_round_trip(tmp_path):
    table = _table()
    path = tmp_path / "sps.json"
    table.save(path)
    assert set(json.loads(path.read_text())) == {"bias_seconds", "bs_probes", "alpha_seconds", "m_probes",
                                                 "theta_seconds"}
    back = AdditiveCostTable.load(path)
    assert back.bias_seconds == table.bias_seconds
    for f in ("bs_probes", "alpha_seconds", "m_probes", "theta_seconds"):
        np.testing.assert_array_equal(getattr(back, f), getattr(table, f))
    assert load_cost_table(None) is None
    assert load_cost_table(path).predict(4, 10) == table.predict(4, 10)


def test_interpolation_and_clamping_on_hand_computed_points():
    t = _table()
    # bs=4 is a probe (alpha 0.3 ms); M = 4 + 28 = 32 is halfway 0..64 -> theta 0.5 ms.
    assert t.predict(4, 28) == pytest.approx(0.004 + 0.0003 + 0.0005)
    # bs=10 is halfway 4..16 -> alpha 0.9 ms; M = 10 + 86 = 96, halfway 64..128 -> theta 2 ms.
    assert t.predict(10, 86) == pytest.approx(0.004 + 0.0009 + 0.002)
    # Clamped: bs above the last probe keeps alpha(16); M above 128 keeps theta(128).
    assert t.predict(100, 900) == pytest.approx(0.004 + 0.0015 + 0.003)
    # Below the first bs probe alpha is alpha(1) (there is no bs 0.5 in practice; the rule holds).
    assert t.alpha(0.5) == pytest.approx(0.0)
    # Vectorised over K: one call prices every budget.
    ks = np.arange(0, 200)
    np.testing.assert_allclose(t.predict(4, ks), [t.predict(4, int(k)) for k in ks])
    assert isinstance(t.predict(4, 3), float)


def test_single_probe_curves_are_constant():
    t = AdditiveCostTable(0.001, [8], [0.0], [64], [0.002])
    np.testing.assert_allclose(t.predict(3, np.arange(50)), 0.003)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.pop("m_probes"), "missing"),
        (lambda d: d.update(extra=1), "unexpected"),
        (lambda d: d.update(bs_probes=[1, 4, 4]), "strictly increasing"),
        (lambda d: d.update(bs_probes=[4, 1, 16]), "strictly increasing"),
        (lambda d: d.update(alpha_seconds=[0.0, 0.1]), "3 probes but"),
        (lambda d: d.update(theta_seconds=[0.0, float("nan"), 0.0]), "finite"),
        (lambda d: d.update(bias_seconds=float("inf")), "finite"),
        (lambda d: d.update(bias_seconds="fast"), "number"),
        (lambda d: d.update(m_probes=[]), "list of numbers|empty"),
        (lambda d: d.update(theta_seconds=["a", 1, 2]), "list of numbers"),
        (lambda d: d.update(bias_seconds=-1.0), "non-positive"),
    ],
)
def test_validation_errors_name_the_problem(mutate, match):
    d = _table().to_dict()
    mutate(d)
    with pytest.raises(CostTableError, match=match):
        AdditiveCostTable.from_dict(d)


def test_load_reports_path_and_bad_json(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(CostTableError, match="not valid JSON"):
        AdditiveCostTable.load(p)
    p.write_text(json.dumps({"bias_seconds": 1.0}))
    with pytest.raises(CostTableError, match="bad.json.*missing"):
        AdditiveCostTable.load(p)


def test_m_bins_round_to_nearest_multiple_halves_up():
    np.testing.assert_array_equal(m_bin_of([0, 31, 32, 95, 96, 100], 64), [0, 0, 64, 64, 128, 128])


# -- fit ---------------------------------------------------------------------------------

TRUE_BIAS = 0.005
TRUE_ALPHA = {1: 0.0, 2: 0.0001, 4: 0.0003, 8: 0.0008, 16: 0.002}
TRUE_THETA = {64: 0.0, 128: 0.0007, 192: 0.0016, 256: 0.0021, 320: 0.0035}


def _grid_samples(rng=None, noise=0.0, repeats=1):
    """Cells (bs, M, T) over a batch x verify-fraction grid, T from the true additive model."""
    out = []
    for _ in range(repeats):
        for bs, a in TRUE_ALPHA.items():
            for m_centre, th in TRUE_THETA.items():
                m = max(bs, m_centre + (-20 if m_centre > 64 else 10))  # inside the bin, not at its centre
                t = TRUE_BIAS + a + th
                if noise:
                    t += rng.normal(0.0, noise)
                out.append((bs, m, t))
    return out


def test_fit_recovers_known_model_exactly_without_noise():
    fit = fit_additive_cost(_grid_samples())
    t = fit.table
    assert not fit.rank_deficient and fit.rank == fit.num_params == 1 + 4 + 4
    assert t.bias_seconds == pytest.approx(TRUE_BIAS, abs=1e-12)
    np.testing.assert_array_equal(t.bs_probes, list(TRUE_ALPHA))
    np.testing.assert_allclose(t.alpha_seconds, list(TRUE_ALPHA.values()), atol=1e-12)
    np.testing.assert_array_equal(t.m_probes, list(TRUE_THETA))
    np.testing.assert_allclose(t.theta_seconds, list(TRUE_THETA.values()), atol=1e-12)
    assert fit.rms_seconds < 1e-12 and fit.r_squared == pytest.approx(1.0)
    np.testing.assert_allclose(fit.residual_seconds, 0.0, atol=1e-12)


def test_fit_with_noise_is_close_and_reports_errors():
    rng = np.random.default_rng(0)
    noise = 2e-5
    fit = fit_additive_cost(_grid_samples(rng, noise=noise, repeats=8))
    t = fit.table
    assert t.bias_seconds == pytest.approx(TRUE_BIAS, abs=4 * fit.bias_std_error + 1e-9)
    np.testing.assert_allclose(t.alpha_seconds, list(TRUE_ALPHA.values()), atol=5e-5)
    np.testing.assert_allclose(t.theta_seconds, list(TRUE_THETA.values()), atol=5e-5)
    assert 0.5 * noise < fit.rms_seconds < 1.5 * noise
    assert fit.r_squared > 0.99
    assert np.all(fit.alpha_std_errors[1:] > 0) and fit.alpha_std_errors[0] == 0
    # fit_additive_table is the same fit, table only.
    assert fit_additive_table(_grid_samples(rng, noise=0.0)).bias_seconds == pytest.approx(TRUE_BIAS)


def test_rank_deficient_fit_warns_but_still_fits_the_cells():
    # Verify-all cells only: every batch size has its own M bin, so alpha and theta cannot be split.
    samples = [(bs, bs * 8, TRUE_BIAS + 0.0001 * bs) for bs in (8, 16, 24, 32)]
    with pytest.warns(RuntimeWarning, match="rank deficient"):
        fit = fit_additive_cost(samples)
    assert fit.rank_deficient
    np.testing.assert_allclose(fit.residual_seconds, 0.0, atol=1e-12)
    for bs, m, sec in samples:
        assert fit.table.predict(bs, m - bs) == pytest.approx(sec, abs=1e-12)


def test_fit_rejects_bad_samples():
    with pytest.raises(CostTableError, match="no samples"):
        fit_additive_cost([])
    with pytest.raises(CostTableError, match="> 0 seconds"):
        fit_additive_cost([(1, 8, 0.0)])
    with pytest.raises(CostTableError, match="below its batch size"):
        fit_additive_cost([(8, 4, 0.01)])
    with pytest.raises(CostTableError, match="integers"):
        fit_additive_cost([(1.5, 8, 0.01)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_additive_cost([(1, 8, 0.01), (1, 8, 0.011)])  # one cell, repeated: full rank (1 param)


# -- monotone fit ------------------------------------------------------------------------


def _bounded_reference(samples, m_bin=64):
    """The same constrained least squares solved independently: alpha and theta as cumulative sums
    of non-negative increments over the sorted probes (scipy's bounded linear least squares)."""
    from scipy.optimize import lsq_linear

    rows = np.asarray(samples, float)
    bs, m, y = rows.T
    bs_p, bi = np.unique(bs, return_inverse=True)
    m_p, mi = np.unique(m_bin_of(m, m_bin), return_inverse=True)
    nb, nm = bs_p.size, m_p.size
    A = np.zeros((len(y), 1 + (nb - 1) + (nm - 1)))
    A[:, 0] = 1.0
    for i in range(len(y)):
        A[i, 1:1 + bi[i]] = 1.0  # alpha_b = d_1 + ... + d_b
        A[i, nb:nb + mi[i]] = 1.0
    lo = np.r_[-np.inf, np.zeros(A.shape[1] - 1)]
    x = lsq_linear(A, y, bounds=(lo, np.full(A.shape[1], np.inf)), tol=1e-14, lsmr_tol="auto").x
    return x[0], np.r_[0.0, np.cumsum(x[1:nb])], np.r_[0.0, np.cumsum(x[nb:])]


def test_monotone_fit_equals_ols_when_ols_is_already_monotone():
    samples = _grid_samples()  # the true model is non-decreasing in bs and M
    ols, mono = fit_additive_cost(samples).table, fit_additive_cost(samples, monotone=True).table
    assert mono.bias_seconds == pytest.approx(ols.bias_seconds, abs=1e-12)
    np.testing.assert_allclose(mono.alpha_seconds, ols.alpha_seconds, atol=1e-12)
    np.testing.assert_allclose(mono.theta_seconds, ols.theta_seconds, atol=1e-12)


def test_monotone_fit_pools_noise_dips_and_matches_a_bounded_solver():
    # A nearly flat curve in M plus noise, as a latency-bound model profiles: OLS puts dips into
    # theta (cheaper to verify more), the constrained fit must not.
    rng = np.random.default_rng(3)
    samples = [(bs, m, 0.003 + 1e-5 * bs + 2e-7 * m + rng.normal(0, 2e-4))
               for bs in (1, 2, 4, 8, 16) for m in range(bs, 8 * bs + 1, max(1, bs))]
    ols = fit_additive_cost(samples)
    assert np.any(np.diff(ols.table.theta_seconds) < 0) or np.any(np.diff(ols.table.alpha_seconds) < 0)
    fit = fit_additive_cost(samples, monotone=True)
    t = fit.table
    assert np.all(np.diff(t.alpha_seconds) >= -1e-15) and np.all(np.diff(t.theta_seconds) >= -1e-15)
    assert t.alpha_seconds[0] == 0 and t.theta_seconds[0] == 0
    bias, alpha, theta = _bounded_reference(samples)
    assert t.bias_seconds == pytest.approx(bias, abs=1e-7)
    np.testing.assert_allclose(t.alpha_seconds, alpha, atol=1e-7)
    np.testing.assert_allclose(t.theta_seconds, theta, atol=1e-7)
    # the constrained fit's residuals are its own, and no better than OLS's
    np.testing.assert_allclose(fit.predicted_seconds + fit.residual_seconds, [s[2] for s in samples])
    assert fit.rms_seconds >= ols.rms_seconds - 1e-15


def test_fit_cells_adds_the_plain_decode_curve():
    """Profiled cells: the speculative ones fit the additive model (an exact one here), the plain
    decode steps give the decode curve (median per batch size, made non-decreasing)."""
    from dspark_jax.spec.dspark.profile import fit_cells

    truth = AdditiveCostTable(1e-3, [1, 8], [0.0, 2e-4], [8, 64, 128], [0.0, 1e-3, 3e-3])
    cells = [{"bs": bs, "K": K, "M": bs + K, "seconds": float(truth.predict(bs, K))}
             for bs in (1, 8) for K in (0, 64 - bs, 128 - bs)]  # M on the 64-token bins: exactly additive
    cells += [{"bs": 1, "K": None, "M": 1, "seconds": s} for s in (4e-4, 5e-4, 9e-4)]
    cells += [{"bs": 8, "K": None, "M": 8, "seconds": s} for s in (3e-4, 3e-4)]  # a noisy dip below bs 1
    fit = fit_cells(cells, monotone=False)
    np.testing.assert_allclose(fit.predicted_seconds, [c["seconds"] for c in cells[:6]], rtol=1e-9)
    assert fit.table.decode_bs_probes.tolist() == [1, 8]
    assert fit.table.decode_seconds.tolist() == pytest.approx([5e-4, 5e-4])  # medians, non-decreasing
