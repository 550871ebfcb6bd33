"""The decode-step profiler's accounting: busy time merges overlapping kernels, gaps are idle time."""

from __future__ import annotations

import pytest

from benchmarks.profile_decode_step import summarize


def test_summarize_busy_gaps_and_grouping():
    # Two steps on a ns timeline: kernels a, b (b overlaps a by 5 ns on another stream), then c.
    events = [
        ("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 20.0, 4.0),      # step 1: busy 0-15, 20-24
        ("a", 30.0, 10.0), ("b", 35.0, 10.0), ("c", 50.0, 4.0),    # step 2: busy 30-45, 50-54
    ]
    out = summarize(events, steps=2, top=2)
    assert out["kernels_per_step"] == 3
    assert out["span_us_per_step"] == pytest.approx(54 / 2 / 1e3)
    assert out["busy_us_per_step"] == pytest.approx((15 + 4 + 15 + 4) / 2 / 1e3)
    # idle: 15-20, 24-30, 45-50 -> 5 + 6 + 5 ns
    assert out["gap_us_per_step"] == pytest.approx(16 / 2 / 1e3)
    assert out["median_gap_us"] == pytest.approx(5 / 1e3)
    assert [k["name"] for k in out["top_kernels"]] == ["a", "b"]  # by total time; ties keep first seen
    assert out["top_kernels"][0]["calls_per_step"] == 1 and out["top_kernels"][0]["us_per_call"] == pytest.approx(0.01)


def test_summarize_launch_sequence_of_last_step():
    events = [("a", 0.0, 10.0), ("b", 12.0, 3.0), ("a", 30.0, 10.0), ("b", 43.0, 3.0)]
    seq = summarize(events, steps=2, top=2, sequence=5)["sequence"]
    assert [k["name"] for k in seq] == ["a", "b"]
    assert [k["us"] for k in seq] == pytest.approx([0.01, 0.003])
    assert [k["gap_before_us"] for k in seq] == pytest.approx([0.0, 0.003])  # 43 - (30 + 10) ns


def test_summarize_without_device_events():
    assert "error" in summarize([], steps=3, top=5)
