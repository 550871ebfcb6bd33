"""bench_speculative's per-cell accounting on a fake engine: medians, relative errors, and the
per-round record that traces a prediction error (no model, no timing claims)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from benchmarks.bench_speculative import cell_groups, run_cell


class _Result:
    def __init__(self):
        self.token_ids = [5, 6, 7]
        self.stats = {"spec": {"accept_lens": [2, 1], "window": 4.0, "block_accept_length": 2.0}}


class _FakeEngine:
    """Each generate call 'reads' three rounds: predicted 1, 2, 3 ms; measured 2, 2, 4 ms; at
    batch 8, 7, 6 with budgets 0, 3, 6; the first not overlapped."""

    def __init__(self):
        keys = ("predicted_step_s", "measured_step_s", "round_log")
        self.stats = {k: collections.deque(maxlen=100) for k in keys}

    def generate(self, prompts, params):
        for i, meas in enumerate((2e-3, 2e-3, 4e-3)):
            self.stats["predicted_step_s"].append((i + 1) * 1e-3)
            self.stats["measured_step_s"].append(meas)
            self.stats["round_log"].append((8 - i, 3 * i, 64, 8, meas, i > 0))
        return [_Result() for _ in prompts]


def test_step_time_accounting_and_per_round_record():
    cell = run_cell({"compact+table": _FakeEngine()}, [["a"]], max_new=8, repeats=2)["compact+table"]
    # the warm-up pass is cleared; two timed passes of three rounds remain
    rounds = cell["step_rounds"]
    assert rounds["overlapped"] == [False, True, True] * 2
    assert rounds["measured_s"] == [2e-3, 2e-3, 4e-3] * 2
    assert rounds["batch_size"] == [8, 7, 6] * 2 and rounds["budget"] == [0, 3, 6] * 2
    assert cell["step_predicted_ms"] == pytest.approx(2.0) and cell["step_measured_ms"] == pytest.approx(2.0)
    # relative errors 0.5, 0, 0.25 per pass: median 0.25; overlapped rounds only: 0, 0.25 -> 0.125
    assert cell["step_median_rel_error"] == pytest.approx(0.25)
    assert cell["step_median_rel_error_overlapped"] == pytest.approx(0.125)
    assert cell["tokens"] == 3 and cell["accept_length"] == pytest.approx(1.5)
    # run level: predicted 12 ms against 16 ms measured over the six rounds
    assert cell["step_prediction"]["total_ratio"] == pytest.approx(12 / 16)
    assert cell["step_prediction"]["rounds"] == 6


class _LoggingEngine:
    """Each generate call logs three rounds (batch, K, tier, verified, seconds, overlapped): a
    synchronous 3 ms and an overlapped 1 ms round at the full batch of 8, then an overlapped 5 ms
    round at batch 6."""

    def __init__(self):
        self.stats = {"round_log": collections.deque(maxlen=100)}
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        self.stats["round_log"].extend([(8, 0, 8, 8, 3e-3, False), (8, 0, 8, 8, 1e-3, True), (6, 0, 8, 6, 5e-3, True)])
        return [_Result() for _ in prompts]


def test_round_periods_at_full_batch_by_regime_after_the_warmups():
    eng = _LoggingEngine()
    cell = run_cell({"static": eng}, [["a"]], max_new=8, repeats=3, warmups=2)["static"]
    assert eng.calls == 2 + 3
    # the warm-up passes' rounds are dropped; the batch-6 rounds are not the full batch
    assert cell["rounds_full_batch_overlapped"] == 3 and cell["round_ms_full_batch_overlapped"] == pytest.approx(1.0)
    assert cell["rounds_full_batch_synchronous"] == 3 and cell["round_ms_full_batch_synchronous"] == pytest.approx(3.0)


def test_cell_groups_single_prompts_at_batch_one_and_waves_above():
    prompts = [f"p{i}" for i in range(10)]
    assert cell_groups(prompts, 1, 3, waves=4) == [["p0"], ["p1"], ["p2"]]
    assert cell_groups(prompts, 2, 3) == [["p0", "p1"]]
    assert cell_groups(prompts, 3, 3, waves=2) == [prompts[:6]]
    assert cell_groups(prompts, 4, 3, waves=5) == [prompts]  # the workload has fewer: all of them


def test_report_pairs_each_arm_with_static_pass_by_pass(tmp_path):
    import argparse
    import json

    from benchmarks.bench_speculative import report

    def row(arm, walls):
        return {"arm": arm, "workload": "math", "batch": 64, "requests": 2, "tokens": 100, "tok_s": 100 / np.median(walls),
                "wall_s": float(np.median(walls)), "wall_s_passes": walls, "outputs": [[1, 2], [3]]}

    # pass 2 ran slow for both arms: the medians of separate passes would pair 1.0 s with 1.1 s
    rows = [row("none", [2.0, 4.0, 2.0]), row("static", [1.0, 2.0, 1.1]), row("compact", [0.8, 2.5, 1.0])]
    args = argparse.Namespace(pair="default", prompts="p", corpus=None, max_new_tokens=8, split="heldout",
                              single_prompts=1, waves=1, repeats=3, dtype=None,
                              matmul_precision=None, execution="default", rounds_per_call=1, temperature=0.0, top_k=0,
                              top_p=1.0, tag="",
                              out_dir=[str(tmp_path)])
    env = {"device": "cpu", "jax": "x", "date": "d", "commit": "c", "platform": "cpu"}
    report(args, env, rows)
    got = {r["arm"]: r for r in json.loads(next(tmp_path.glob("*.json")).read_text())["rows"]}
    assert got["compact"]["paired_speedup_vs_static"] == pytest.approx([1.0 / 0.8, 2.0 / 2.5, 1.1 / 1.0])
    assert "paired_speedup_vs_static" not in got["static"] and got["none"]["paired_speedup_vs_static"] == \
        pytest.approx([0.5, 0.5, 0.55])
    md = next(tmp_path.glob("*.md")).read_text()
    assert "| math | 64 | 2 | compact | " in md and "1.10 [0.80, 1.25]" in md


def test_arm_names_carry_rounds_per_dispatch():
    from benchmarks.bench_speculative import parse_arm

    assert parse_arm("static") == ("static", 1) and parse_arm("compact+table", 3) == ("compact+table", 3)
    assert parse_arm("static@2", 1) == ("static", 2) and parse_arm("mtp1") == ("mtp1", 1)
    for bad in ("static@0", "none@2", "mtp@2", "static@x", "dynamic", "static:a8"):
        with pytest.raises(ValueError):
            parse_arm(bad)


def test_mixed_traffic_statistics_per_workload_weigh_every_round_alike():
    # two code requests (4 rounds accepting 3 each; 1 round accepting 1) and one math request
    # (2 rounds accepting 8): sums (accepted, rounds, window, block accept)
    from benchmarks.bench_speculative import by_workload_stats, round_means

    code_a = (12.0, 4, 4 * 6.0, 4 * 3.0)
    code_b = (1.0, 1, 1 * 8.0, 1 * 2.0)
    math = (16.0, 2, 2 * 8.0, 2 * 8.0)
    stats = by_workload_stats([code_a, math, code_b], ["code", "math", "code", "verse"])
    assert set(stats) == {"code", "math"}  # labels past the requests are ignored
    # code: 13 accepted over 5 rounds; windows (24 + 8) / 5; block accepts 14: utilization 13 / 14
    assert stats["code"]["requests"] == 2
    assert stats["code"]["accept_length"] == pytest.approx(13 / 5)
    assert stats["code"]["window"] == pytest.approx(32 / 5)
    assert stats["code"]["utilization"] == pytest.approx(13 / 14)
    assert stats["math"]["accept_length"] == pytest.approx(8.0) and stats["math"]["utilization"] == pytest.approx(1.0)
    # the whole cell: 29 accepted over 7 rounds, block accepts 30
    overall = round_means([code_a, math, code_b])
    assert overall["accept_length"] == pytest.approx(29 / 7) and overall["utilization"] == pytest.approx(29 / 30)
