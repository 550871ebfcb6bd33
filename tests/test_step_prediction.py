"""benchmarks/step_prediction.py on hand-computed rounds."""

import numpy as np
import pytest

from benchmarks.step_prediction import batch_bucket, prediction_summary, summarize_results


def test_buckets_are_the_nearest_power_of_two_in_log_scale():
    assert batch_bucket([1, 2, 3, 5, 6, 45, 46, 64]).tolist() == [1, 2, 4, 4, 8, 32, 64, 64]


def test_summary_by_hand():
    # group (64, overlapped): measured 1, 2, 3 ms (median 2); group (64, synchronous): 4 ms.
    measured = [1e-3, 2e-3, 3e-3, 4e-3]
    predicted = [2e-3, 2e-3, 2e-3, 5e-3]
    s = prediction_summary(predicted, measured, [64, 60, 64, 64], [True, True, True, False])
    assert s["rounds"] == 4
    assert s["total_ratio"] == pytest.approx(11 / 10)
    # per-round errors 1, 0, 1/3, 1/4 -> median (1/4 + 1/3) / 2
    assert s["median_rel_error"] == pytest.approx((1 / 4 + 1 / 3) / 2)
    # oracle: 2 ms for the overlapped rounds (errors 1, 0, 1/3), 4 ms for the other (0)
    assert s["jitter_floor"] == pytest.approx((0 + 1 / 3) / 2)
    assert s["groups"] == [
        {"batch_bucket": 64, "overlapped": False, "rounds": 1, "median_predicted_ms": pytest.approx(5.0),
         "median_measured_ms": pytest.approx(4.0)},
        {"batch_bucket": 64, "overlapped": True, "rounds": 3, "median_predicted_ms": pytest.approx(2.0),
         "median_measured_ms": pytest.approx(2.0)}]


def test_summary_rejects_bad_rounds():
    with pytest.raises(ValueError, match="equal-length"):
        prediction_summary([1.0], [1.0, 2.0], [1, 1], [True, True])
    with pytest.raises(ValueError, match="> 0"):
        prediction_summary([1.0], [0.0], [1], [True])


def test_summarize_results_reads_the_bench_rows():
    rounds = {"predicted_s": [1.0, 1.0], "measured_s": [1.0, 2.0], "batch_size": [8, 8], "overlapped": [True, True]}
    rows = [{"arm": "static", "workload": "code", "batch": 8},
            {"arm": "compact+table", "workload": "code", "batch": 8, "step_rounds": rounds}]
    (cell,) = summarize_results({"rows": rows})
    assert (cell["workload"], cell["batch"], cell["rounds"]) == ("code", 8, 2)
    assert cell["total_ratio"] == pytest.approx(2 / 3)
    np.testing.assert_allclose(cell["median_rel_error"], (0 + 0.5) / 2)
