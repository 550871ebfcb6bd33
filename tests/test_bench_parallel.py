"""benchmarks/bench_parallel.py on 4 forced CPU devices at tiny sizes: every (tp, dp) cell of
both arms runs, commits the tp 1 / dp 1 tokens, and the JSON, markdown and PNG are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_parallel_smoke(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "benchmarks/bench_parallel.py", "--pair", "tiny", "--tp", "1", "2", "--dp", "1", "2",
           "--batch-sizes", "2", "--max-new-tokens", "4", "--prompt-len", "6", "--repeats", "1",
           "--out-dir", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "parallel_tiny_cpu.json").read_text())
    cells = {(r["arm"], r["tp"], r["dp"]) for r in data["rows"]}
    assert cells == {(a, tp, dp) for a in ("plain", "dspark") for tp in (1, 2) for dp in (1, 2)}
    assert all(r["equals_tp1_dp1"] and r["equals_plain"] for r in data["rows"])
    assert all(r["generated_tokens"] == 4 * 2 * r["dp"] for r in data["rows"])
    assert {"device", "jax", "date", "commit"} <= set(data["env"])
    assert (tmp_path / "parallel_tiny_cpu.md").read_text().startswith("# Tensor / data parallelism")
    assert (tmp_path / "parallel_tiny_cpu.png").stat().st_size > 1000
