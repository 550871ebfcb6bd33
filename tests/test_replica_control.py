"""benchmarks/replica_control.py: pooled paired ratios against a replica of the reference arm."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.replica_control import compare, pooled_ratio


def _row(workload, arm, walls):
    return {"workload": workload, "batch": 64, "arm": arm, "wall_s_passes": list(walls)}


def test_pooled_median_is_the_median_pass_ratio_and_its_interval_contains_it():
    # passes with ratios 0.5, 1, 2 (log -l, 0, l) and 1, 1: the median pass ratio is 1
    logs = [np.log([0.5, 1.0, 2.0]), np.log([1.0, 1.0])]
    p = pooled_ratio(logs, resamples=500)
    assert p["passes"] == 5 and p["median"] == pytest.approx(1.0)
    assert p["ci95"][0] <= 1.0 <= p["ci95"][1] and p["ci95"][0] >= 0.5 and p["ci95"][1] <= 2.0


def test_an_arm_as_fast_as_the_reference_is_inside_the_replica_interval_and_a_faster_one_is_not():
    rng = np.random.default_rng(1)
    rows = []
    for w in ("code", "math"):
        ref = 1.0 + 0.02 * rng.standard_normal(40)
        rows += [_row(w, "static", ref), _row(w, "static@2", ref * np.exp(0.02 * rng.standard_normal(40))),
                 _row(w, "same", ref * np.exp(0.02 * rng.standard_normal(40))),
                 _row(w, "faster", ref / 1.2 * np.exp(0.02 * rng.standard_normal(40)))]
    out = compare([{"rows": rows}], ["same", "faster"], "static@2")
    arms = out["arms"]
    assert arms["same"]["inside_replica_interval"] and not arms["faster"]["inside_replica_interval"]
    assert arms["faster"]["median"] == pytest.approx(1.2, rel=0.02)
    # per cell: the median of that cell's pass ratios, by hand
    code = [r for r in rows if r["workload"] == "code"]
    ref, fast = (np.asarray(next(r for r in code if r["arm"] == a)["wall_s_passes"]) for a in ("static", "faster"))
    cell = next(c for c in arms["faster"]["cells"] if c["workload"] == "code")
    assert cell["median"] == pytest.approx(np.median(ref / fast))


def test_unpaired_passes_are_an_error():
    rows = [_row("code", "static", [1.0, 1.0]), _row("code", "static@2", [1.0])]
    with pytest.raises(ValueError, match="do not pair"):
        compare([{"rows": rows}], [], "static@2")
