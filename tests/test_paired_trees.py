"""benchmarks/paired_trees.py's summary on hand-computed runs (no benchmark is run)."""

from __future__ import annotations

import pytest

from benchmarks.paired_trees import markdown, summarize


def _run(tree, rnd, tok_s):
    return {"tree": tree, "round": rnd, "rows": [{"workload": "code", "batch": 64, "arm": "none", "tok_s": tok_s}]}


def test_ratios_pair_the_runs_of_one_round_and_spreads_measure_each_tree():
    runs = [_run("before", 1, 100.0), _run("after", 1, 80.0), _run("after", 2, 90.0), _run("before", 2, 120.0),
            _run("before", 3, 110.0)]  # round 3's after run wrote nothing (cut short)
    (cell,) = summarize(runs)
    assert cell["before_median"] == pytest.approx(110.0) and cell["before_spread"] == pytest.approx(1.2)
    assert cell["after_median"] == pytest.approx(85.0) and cell["after_spread"] == pytest.approx(90 / 80)
    assert cell["ratio_per_round"] == pytest.approx([0.8, 0.75])  # round 3 has no pair
    assert cell["ratio_median"] == pytest.approx(0.775)
    md = markdown([cell], "# h")
    assert "| code | 64 | none | 110 | 1.20 | 85 | 1.12 | 0.80, 0.75 | 0.78 |" in md
    assert "median 0.78" in md


def test_a_cell_only_one_tree_ran_has_no_ratio():
    (cell,) = summarize([_run("before", 1, 100.0)])
    assert cell["after_median"] is None and cell["ratio_median"] is None
    assert "| code | 64 | none | 100 | - | - | - | - | - |" in markdown([cell], "# h")
