"""The head-ablation table (benchmarks/head_ablation.py) on two hand-written runs."""

from __future__ import annotations

import json

import pytest

from benchmarks.head_ablation import gains, markdown, rows


def _run(root, head, steps, taus):
    d = root / head
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"steps": steps, "planned_steps": 100, "elapsed_s": 50.0,
                                                "parameters": 10}))
    (d / "eval.json").write_text(json.dumps({w: {"tau_greedy": g, "tau_probabilistic": p, "ce": 1.0}
                                             for w, (g, p) in taus.items()}))


def test_each_head_is_reported_against_the_headless_drafter(tmp_path):
    _run(tmp_path, "none", 100, {"code": (2.0, 1.5), "math": (4.0, 3.0)})
    _run(tmp_path, "vanilla", 80, {"code": (2.5, 1.8), "math": (4.6, 3.0)})
    table = gains(rows(tmp_path, ["none", "vanilla"]))
    vanilla = table[1]["over_none"]
    assert vanilla["code"]["tau_greedy"] == pytest.approx(1.25) and vanilla["code"]["tau_probabilistic"] == pytest.approx(1.2)
    assert vanilla["math"]["tau_greedy"] == pytest.approx(1.15) and vanilla["math"]["tau_probabilistic"] == pytest.approx(1.0)
    md = markdown(table, {"device": "cpu", "jax": "x", "date": "d", "commit": "c"})
    assert "| vanilla | 80 of 100 | 50 | 2.50 / 1.80 (1.25x / 1.20x) | 4.60 / 3.00 (1.15x / 1.00x) |" in md
    assert "| none | 100 | 50 | 2.00 / 1.50 | 4.00 / 3.00 |" in md
