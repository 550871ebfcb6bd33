"""STS calibration and confidence metrics (pure numpy): hand cases, synthetic fits, JSON, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dspark_jax.calibration import (
    ConfidenceMetricsAccumulator,
    StsCalibration,
    auroc,
    auroc_histogram,
    brier_score,
    check_prefix_labels,
    confidence_metrics_by_position,
    expected_calibration_error,
    fit_sts,
    prefix_labels_from_accept_counts,
    reliability_table,
    sigmoid,
    temperature_grid,
)
from training import calibrate_sts

# ---------------------------------------------------------------- metrics on hand-computed cases


def test_ece_hand_three_bins():
    # 3 bins: [0, 1/3), [1/3, 2/3), [2/3, 1].
    #   bin 0: preds 0.1, 0.2  labels 0, 0  -> mean pred 0.15, mean label 0.0, gap 0.15
    #   bin 1: preds 0.4, 0.6  labels 1, 0  -> mean pred 0.50, mean label 0.5, gap 0.00
    #   bin 2: preds 0.7, 0.9  labels 1, 0  -> mean pred 0.80, mean label 0.5, gap 0.30
    # ECE = (2·0.15 + 2·0 + 2·0.30) / 6 = 0.15
    pred = [0.1, 0.2, 0.4, 0.6, 0.7, 0.9]
    label = [0, 0, 1, 0, 1, 0]
    assert expected_calibration_error(pred, label, num_bins=3) == pytest.approx(0.15)


def test_ece_hand_two_bins_edges():
    # 2 bins: [0, 0.5), [0.5, 1]; 0.5 falls in the upper bin and 1.0 stays in the last one.
    #   bin 0: preds 0.0, 0.25     labels 0, 1  -> mean pred 0.125, mean label 0.5,   gap 0.375
    #   bin 1: preds 0.5, 1.0, 1.0 labels 1, 1, 0 -> mean pred 5/6, mean label 2/3, gap 1/6
    # ECE = (2·0.375 + 3·(1/6)) / 5 = (0.75 + 0.5) / 5 = 0.25
    pred = [0.0, 0.25, 0.5, 1.0, 1.0]
    label = [0, 1, 1, 1, 0]
    assert expected_calibration_error(pred, label, num_bins=2) == pytest.approx(0.25)
    table = reliability_table(pred, label, num_bins=2)
    assert table.count.tolist() == [2, 3]
    np.testing.assert_allclose(table.mean_prediction, [0.125, 5 / 6])
    np.testing.assert_allclose(table.mean_label, [0.5, 2 / 3])
    assert table.ece == pytest.approx(0.25)


def test_ece_perfect_and_default_bins():
    # Each distinct prediction equals its bin's label frequency -> ECE 0 at 15 bins.
    pred = [0.25] * 4 + [0.9] * 10
    label = [1, 0, 0, 0] + [1] * 9 + [0]
    assert expected_calibration_error(pred, label) == pytest.approx(0.0, abs=1e-12)


def test_brier_hand():
    # ((0.9−1)² + (0.2−0)² + (0.6−0)²) / 3 = (0.01 + 0.04 + 0.36) / 3
    assert brier_score([0.9, 0.2, 0.6], [1, 0, 0]) == pytest.approx(0.41 / 3)


def _brute_force_auroc(pred, label):
    pos = [p for p, y in zip(pred, label) if y == 1]
    neg = [p for p, y in zip(pred, label) if y == 0]
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def test_auroc_hand_and_brute_force_with_ties():
    # pos {0.8, 0.5}, neg {0.5, 0.2}: pairs 0.8>0.5, 0.8>0.2, 0.5=0.5 (½), 0.5>0.2 -> 3.5 / 4
    assert auroc([0.8, 0.5, 0.5, 0.2], [1, 1, 0, 0]) == pytest.approx(0.875)
    rng = np.random.default_rng(0)
    for _trial in range(5):
        pred = np.round(rng.random(300), 1)  # 11 distinct values: many ties
        label = (rng.random(300) < pred * 0.8 + 0.1).astype(int)
        assert auroc(pred, label) == pytest.approx(_brute_force_auroc(pred, label), abs=1e-12)


def test_auroc_histogram_is_exact_auroc_of_binned_predictions():
    rng = np.random.default_rng(1)
    pred = rng.random(500)
    label = (rng.random(500) < pred).astype(int)
    binned = np.minimum(np.floor(pred * 1024), 1023)
    assert auroc_histogram(pred, label) == pytest.approx(_brute_force_auroc(binned, label), abs=1e-12)
    assert auroc_histogram(pred, label) == pytest.approx(auroc(pred, label), abs=1e-3)


def test_auroc_single_class_is_nan():
    assert math.isnan(auroc([0.3, 0.7], [1, 1]))
    assert math.isnan(auroc_histogram([0.3, 0.7], [0, 0]))


@pytest.mark.parametrize("pred,label,match", [
    ([0.1, 1.5], [0, 1], "in \\[0, 1\\]"),
    ([0.1, float("nan")], [0, 1], "NaN"),
    ([0.1, 0.2], [0, 1, 1], "equal length"),
])
def test_metric_input_errors(pred, label, match):
    with pytest.raises(ValueError, match=match):
        expected_calibration_error(pred, label)


def test_auroc_rejects_soft_labels():
    with pytest.raises(ValueError, match="0 or 1"):
        auroc([0.1, 0.2], [0.5, 1])


@pytest.mark.parametrize("fold_rows", [1, 200, 10_000])
def test_accumulator_matches_batch_metrics(fold_rows):
    """Streamed metrics equal the batch ones whether rows were folded per update, in batches
    (one fold after 250 rows, 150 rows still pending at the first read) or only when read, and
    updates after a read keep counting."""
    rng = np.random.default_rng(2)
    survival = np.cumprod(rng.random((500, 3)), axis=1)
    labels = prefix_labels_from_accept_counts(rng.integers(0, 4, 500), 3)
    acc = ConfidenceMetricsAccumulator(3, fold_rows=fold_rows)
    for lo, hi in ((0, 150), (150, 250), (250, 400)):
        acc.update(survival[lo:hi], labels[lo:hi].astype(bool) if lo else labels[lo:hi])
    first = acc.summary()
    np.testing.assert_allclose(first["ece"], confidence_metrics_by_position(survival[:400], labels[:400])["ece"],
                               rtol=1e-9)
    acc.update(survival[400:], labels[400:])
    streamed, batch = acc.summary(), confidence_metrics_by_position(survival, labels)
    for key in ("ece", "brier", "mean_prediction", "mean_label"):
        np.testing.assert_allclose(streamed[key], batch[key], rtol=1e-9, err_msg=key)
    np.testing.assert_allclose(streamed["auroc"], [auroc_histogram(survival[:, k], labels[:, k]) for k in range(3)])
    assert acc.count.sum() == 500 * 3


def test_accumulator_rejects_bad_rows_at_update():
    acc = ConfidenceMetricsAccumulator(2)
    with pytest.raises(ValueError, match="probabilities"):
        acc.update([[0.5, np.nan]], [[1, 0]])
    with pytest.raises(ValueError, match="probabilities"):
        acc.update([[1.5, 0.2]], [[1, 0]])
    with pytest.raises(ValueError, match="0 or 1"):
        acc.update([[0.5, 0.2]], [[1, 0.5]])
    with pytest.raises(ValueError, match="block_size 2"):
        acc.update([[0.5, 0.2, 0.1]], [[1, 0, 0]])
    assert acc.count.sum() == 0  # nothing bad was kept


# ---------------------------------------------------------------- labels


def test_prefix_labels_from_counts():
    labels = prefix_labels_from_accept_counts([0, 2, 3], block_size=3)
    assert labels.tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    with pytest.raises(ValueError, match="integers in \\[0, 3\\]"):
        prefix_labels_from_accept_counts([4], block_size=3)
    with pytest.raises(ValueError, match="integers"):
        prefix_labels_from_accept_counts([1.5], block_size=3)


def test_prefix_labels_validation():
    check_prefix_labels([[1, 1, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="1 after a 0.*row 1"):
        check_prefix_labels([[1, 0, 0], [1, 0, 1]])
    with pytest.raises(ValueError, match="0 or 1"):
        check_prefix_labels([[1, 2, 0]])
    with pytest.raises(ValueError, match="block_size 3, expected 4"):
        check_prefix_labels([[1, 1, 0]], block_size=4)
    with pytest.raises(ValueError, match="rows of labels"):
        fit_sts(np.zeros((3, 2)), np.zeros((2, 2)))


# ---------------------------------------------------------------- STS on synthetic data

DISTORTIONS = (3.0, 0.3, 2.0, 0.5, 3.0)  # ×3 over-confident ... ×0.3 under-confident, per position


def _synthetic(n, seed, distortions=DISTORTIONS):
    """True conditional acceptance σ(true logit); labels sampled as a prefix; logits distorted."""
    rng = np.random.default_rng(seed)
    true_logits = rng.normal(1.5, 1.5, size=(n, len(distortions)))
    accepted = rng.random(true_logits.shape) < sigmoid(true_logits)
    labels = np.cumprod(accepted, axis=1).astype(np.int8)
    return true_logits * np.asarray(distortions), labels


@pytest.fixture(scope="module")
def synthetic_fit():
    logits, labels = _synthetic(20000, seed=0)
    return logits, labels, fit_sts(logits, labels, progress=False)


def test_sts_lowers_ece_at_every_position(synthetic_fit):
    logits, labels, fit = synthetic_fit
    before = confidence_metrics_by_position(StsCalibration.identity(len(DISTORTIONS)).survival(logits), labels)
    after = confidence_metrics_by_position(fit.calibration.survival(logits), labels)
    assert all(a < b for a, b in zip(after["ece"], before["ece"])), (before["ece"], after["ece"])
    # Observed over 30 seeds: ECE before 0.03-0.13 per position, mean ECE after <= 0.011.
    assert np.mean(after["ece"]) < 0.02
    # The fit's own objective at the chosen T is the reported ECE after.
    chosen = [fit.objective[k].min() for k in range(len(DISTORTIONS))]
    np.testing.assert_allclose(chosen, after["ece"], atol=1e-12)


def test_sts_recovers_distortion_temperatures(synthetic_fit):
    _, _, fit = synthetic_fit
    # Dividing by T_k undoes a ×c_k distortion, so T_k ≈ c_k.  The grid is 0.05 apart in log10;
    # allow two steps (observed worst over 30 seeds: 0.077, from sampling noise at later positions).
    error = np.abs(np.log10(fit.calibration.temperatures) - np.log10(DISTORTIONS))
    assert error.max() <= 0.1 + 1e-9, (fit.calibration.temperatures, error)
    assert not fit.at_grid_edge


def test_sts_never_reorders_per_position_confidences(synthetic_fit):
    logits, _, fit = synthetic_fit
    # Temperature scaling is monotone per position, so the per-position conditional confidences
    # σ(z_k/T_k) keep their order across samples.  The *cumulative* survival's order is not
    # invariant (with different T per position, Π σ(z_i/T_i) can legitimately rank two samples
    # differently from Π σ(z_i)), so that is deliberately not asserted.
    raw = StsCalibration.identity(len(DISTORTIONS)).confidence(logits)
    calibrated = fit.calibration.confidence(logits)
    for k in range(len(DISTORTIONS)):
        order = np.argsort(logits[:, k], kind="stable")
        assert np.all(np.diff(calibrated[order, k]) >= 0)
        np.testing.assert_array_equal(np.argsort(raw[:, k], kind="stable"),
                                      np.argsort(calibrated[:, k], kind="stable"))


def test_sts_tie_break_prefers_temperature_one():
    # Logits all 0: σ(0/T) = 0.5 for every T, so every grid value ties; choose T = 1.
    labels = prefix_labels_from_accept_counts([0, 1, 2, 2], 2)
    fit = fit_sts(np.zeros((4, 2)), labels, progress=False)
    assert fit.calibration.temperatures == (1.0, 1.0)
    # No 1 in the grid: 0.5 and 2 are equally far from 1 in log space -> the smaller one.
    assert fit_sts(np.zeros((4, 2)), labels, grid=[2.0, 0.5], progress=False).calibration.temperatures == (0.5, 0.5)


def test_temperature_grid_default():
    grid = temperature_grid()
    assert grid.size == 41 and grid[0] == pytest.approx(0.1) and grid[-1] == pytest.approx(10.0)
    assert grid[20] == 1.0
    np.testing.assert_allclose(np.diff(np.log10(grid)), 0.05)


def test_calibration_application_is_stable_and_correct():
    cal = StsCalibration((2.0, 0.5))
    z = np.array([[1.0, -1.0], [1000.0, -1000.0]])
    np.testing.assert_allclose(cal.confidence(z)[0], [sigmoid(0.5), sigmoid(-2.0)])
    np.testing.assert_allclose(cal.survival(z)[0], [sigmoid(0.5), sigmoid(0.5) * sigmoid(-2.0)])
    assert np.all(np.isfinite(cal.survival(z)))
    with pytest.raises(ValueError, match="\\[..., 2\\]"):
        cal.confidence(np.zeros((1, 3)))


# ---------------------------------------------------------------- JSON


def test_json_round_trip(tmp_path):
    cal = StsCalibration((0.5, 1.0, 2.5))
    path = tmp_path / "sts.json"
    cal.save(path, {"dataset": "math", "ece_before": [0.1, None, 0.2]})
    assert StsCalibration.load(path, block_size=3) == cal
    assert json.loads(path.read_text())["dataset"] == "math"
    assert StsCalibration.from_json(cal.to_json()) == cal
    assert StsCalibration.from_json('{"sts_temperatures": [0.5, 1, 2.5]}') == cal
    assert StsCalibration.identity(3).is_identity and not cal.is_identity


@pytest.mark.parametrize("text,match", [
    ('{"ece_after": [0.1]}', "no 'temperatures' or 'sts_temperatures'"),
    ('{"temperatures": [1.0, 0.0]}', "temperature 1 must be finite and > 0"),
    ('{"temperatures": [1.0, -2.0]}', "temperature 1 must be finite and > 0"),
    ('{"temperatures": [NaN]}', "finite"),
    ('{"temperatures": [Infinity]}', "finite"),
    ('{"temperatures": [1.0, "2"]}', "not a number"),
    ('{"temperatures": [true]}', "not a number"),
    ('{"temperatures": []}', "empty"),
    ('{"temperatures": 1.0}', "list of numbers"),
    ('[1.0, 2.0]', "JSON object"),
    ('{"temperatures": [1.0], "sts_temperatures": [2.0]}', "differ"),
    ('{"temperatures": [1.0', "not valid JSON"),
])
def test_json_validation_errors(text, match):
    with pytest.raises(ValueError, match=match):
        StsCalibration.from_json(text)


def test_load_checks_block_size(tmp_path):
    path = tmp_path / "sts.json"
    StsCalibration((1.0, 2.0)).save(path)
    with pytest.raises(ValueError, match="2 temperatures but the drafter's block size is 3"):
        StsCalibration.load(path, block_size=3)


# ---------------------------------------------------------------- CLI


def test_cli_end_to_end(tmp_path, capsys):
    logits, labels = _synthetic(3000, seed=1, distortions=(3.0, 0.5, 2.0))
    shards = tmp_path / "shards"
    shards.mkdir()
    np.savez(shards / "a.npz", logits=logits[:2000].astype(np.float32), num_accepted_drafts=labels[:2000].sum(1))
    np.savez(shards / "b.npz", logits=logits[2000:], prefix_mask=labels[2000:])
    out = tmp_path / "out" / "sts.json"
    assert calibrate_sts.main([str(shards), "--dataset", "synthetic", "--out", str(out), "--block-size", "3"]) == 0

    record = json.loads(out.read_text())
    assert record["dataset"] == "synthetic" and record["num_samples"] == 3000 and record["block_size"] == 3
    assert record["grid"] == {"min": 0.1, "max": 10.0, "num": 41, "spacing": "log"}
    for key in ("ece", "auroc", "brier"):
        assert len(record[f"{key}_before"]) == len(record[f"{key}_after"]) == 3
    assert np.mean(record["ece_after"]) < np.mean(record["ece_before"])
    assert StsCalibration.load(out, block_size=3).temperatures == tuple(record["temperatures"])
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "block size 3" in capsys.readouterr().out


def test_cli_apply_scores_a_given_calibration_on_held_out_shards(tmp_path, capsys):
    """--apply fits nothing: "ECE after" is the ECE of the given temperatures on these shards,
    checked against a 15-bin ECE written out here."""
    logits, labels = _synthetic(2500, seed=4, distortions=(2.0, 0.7, 1.5))
    np.savez(tmp_path / "heldout.npz", logits=logits, prefix_mask=labels)
    temps = (1.7, 0.8, 1.2)
    StsCalibration(temps).save(tmp_path / "sts.json")
    out = tmp_path / "report.json"
    assert calibrate_sts.main([str(tmp_path / "heldout.npz"), "--apply", str(tmp_path / "sts.json"),
                               "--dataset", "held-out", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["temperatures"] == list(temps) and record["applied"] == str(tmp_path / "sts.json")
    assert "grid" not in record

    survival = np.cumprod(1 / (1 + np.exp(-logits / np.array(temps))), axis=1)
    for k in range(3):
        bins = np.minimum((survival[:, k] * 15).astype(int), 14)
        ece = sum(abs(survival[bins == b, k].mean() - labels[bins == b, k].mean()) * (bins == b).sum()
                  for b in range(15) if (bins == b).any()) / len(bins)
        assert record["ece_after"][k] == pytest.approx(ece, abs=1e-6)
    assert "sts.json applied to" in capsys.readouterr().out


def test_cli_breaks_calibration_down_by_group(tmp_path, capsys):
    """Two groups whose logits are shifted in opposite directions: a temperature cannot undo a
    shift, so the pooled STS fit leaves one group under-confident and (at position 1) the other
    over-confident, each worse than the pooled ECE; by_group says so, with each group's rows
    counted and its own mean label."""
    rng = np.random.default_rng(3)
    true = rng.normal(1.0, 1.5, size=(4000, 3))
    labels = np.cumprod(rng.random(true.shape) < sigmoid(true), axis=1).astype(np.int8)
    shift = np.where(np.arange(4000) < 2000, -1.5, 1.5)[:, None]  # group u: logits too low, o: too high
    np.savez(tmp_path / "s.npz", logits=true + shift, num_accepted_drafts=labels.sum(1),
             group_ids=(np.arange(4000) >= 2000).astype(np.int16), group_names=np.array(["u", "o"]))
    out = tmp_path / "sts.json"
    assert calibrate_sts.main([str(tmp_path / "s.npz"), "--dataset", "g", "--out", str(out)]) == 0
    by = json.loads(out.read_text())["by_group"]
    assert sorted(by) == ["o", "u"] and by["u"]["num_samples"] == by["o"]["num_samples"] == 2000
    pooled = json.loads(out.read_text())["ece_after"]
    # position 1: opposite biases, each group worse calibrated than the pool it was fitted on
    assert by["u"]["mean_survival_after"][0] < by["u"]["mean_label"][0]
    assert by["o"]["mean_survival_after"][0] > by["o"]["mean_label"][0]
    assert min(by["u"]["ece_after"][0], by["o"]["ece_after"][0]) > pooled[0]
    for k in range(3):
        assert by["u"]["mean_survival_after"][k] < by["u"]["mean_label"][k]
        np.testing.assert_allclose(by["u"]["mean_label"][k], labels[:2000, k].mean())
        np.testing.assert_allclose(by["o"]["mean_label"][k], labels[2000:, k].mean())
    assert "group 'u' (n=2000)" in capsys.readouterr().out
    # a final-round flag gives the final / earlier breakdown, rows counted
    np.savez(tmp_path / "f.npz", logits=true, num_accepted_drafts=labels.sum(1),
             final_round=np.arange(4000) % 10 == 0)
    assert calibrate_sts.main([str(tmp_path / "f.npz"), "--dataset", "g", "--out", str(out)]) == 0
    by_round = json.loads(out.read_text())["by_round"]
    assert by_round["final"]["num_samples"] == 400 and by_round["earlier"]["num_samples"] == 3600
    np.testing.assert_allclose(by_round["final"]["mean_label"][0], labels[::10, 0].mean())
    # shards without groups: no breakdown
    np.savez(tmp_path / "plain.npz", logits=true, num_accepted_drafts=labels.sum(1))
    assert calibrate_sts.load_groups([tmp_path / "plain.npz"]) is None
    assert calibrate_sts.load_final_rounds([tmp_path / "plain.npz"]) is None


def test_cli_rejects_bad_shards(tmp_path):
    np.savez(tmp_path / "a.npz", logits=np.zeros((4, 3)), num_accepted_drafts=np.array([0, 1, 2, 3]))
    np.savez(tmp_path / "b.npz", logits=np.zeros((4, 2)), num_accepted_drafts=np.array([0, 1, 2, 2]))
    np.savez(tmp_path / "c.npz", logits=np.zeros((2, 2)), prefix_mask=np.array([[0, 1], [1, 1]]))
    np.savez(tmp_path / "d.npz", confidences=np.zeros((2, 2)))
    out = ["--dataset", "x", "--out", str(tmp_path / "o.json")]
    with pytest.raises(ValueError, match="disagree on block size"):
        calibrate_sts.main([str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), *out])
    with pytest.raises(ValueError, match="c.npz: .*1 after a 0"):
        calibrate_sts.main([str(tmp_path / "c.npz"), *out])
    with pytest.raises(ValueError, match="needs one of"):
        calibrate_sts.main([str(tmp_path / "d.npz"), *out])
    with pytest.raises(FileNotFoundError):
        calibrate_sts.main([str(tmp_path / "missing.npz"), *out])
