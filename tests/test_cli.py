"""`python -m dspark_jax.generate` end to end, in a subprocess like a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_jax.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


# The engine sizes of the session's tiny_engine (tests/conftest.py), and the tests' matmul
# precision: the subprocess compiles what tiny_engine compiled, so it finds those executables in
# the persistent compilation cache instead of compiling the CLI's default batch sizes.
SIZES = ["--max-running-requests", "4", "--max-prefill-tokens", "64", "--max-model-len", "256"]


def _run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest")
    return subprocess.run([sys.executable, "-m", "dspark_jax.generate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_json_lines_in_prompt_order(hf_model_dir, tiny_engine):
    p = _run("--model-path", str(hf_model_dir), "--prompt", "def f(x):", "--prompt-ids", "5,6,7",
             "--max-new-tokens", "6", "--ignore-eos", *SIZES, "--json")
    assert p.returncode == 0, p.stderr
    lines = [json.loads(l) for l in p.stdout.strip().splitlines()]
    assert len(lines) == 2
    want = tiny_engine.generate(["def f(x):", [5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    for got, w in zip(lines, want):
        assert got["token_ids"] == w.token_ids and got["text"] == w.text and got["finish_reason"] == "length"


def test_bad_arguments_exit_nonzero_with_message(hf_model_dir, tmp_path):
    p = _run("--model-path", str(tmp_path / "missing"), "--prompt", "x")
    assert p.returncode == 1 and "does not exist" in p.stderr
    p = _run("--model-path", str(hf_model_dir), "--prompt", "x", "--max-new-tokens", "0")
    assert p.returncode == 1 and "max_new_tokens" in p.stderr
    p = _run("--model-path", str(hf_model_dir), "--prompt-ids", "1,x")
    assert p.returncode == 2 and "comma-separated" in p.stderr


@pytest.mark.slow
def test_speculative_flags_give_plain_greedy_tokens_and_spec_stats(hf_model_dir, tmp_path, tiny_engine):
    from flax import nnx

    from dspark_jax.checkpoint import load_model
    from dspark_jax.spec.dspark.checkpoint import save_drafter
    from dspark_jax.spec.dspark.config import DSparkConfig
    from dspark_jax.spec.dspark.model import DSparkDrafter

    cfg, _ = load_model(hf_model_dir)
    dcfg = DSparkConfig.from_target(cfg, num_layers=1, block_size=3, mask_token_id=3, markov_rank=8, target_layer_ids=(0,))
    save_drafter(tmp_path / "d", dcfg, DSparkDrafter(dcfg, rngs=nnx.Rngs(0)), dtype="float32")
    common = ["--model-path", str(hf_model_dir), "--prompt-ids", "5,6,7", "--prompt", "def f(x):", "--max-new-tokens", "8",
              "--ignore-eos", *SIZES, "--json", "--speculative-algorithm", "DSPARK",
              "--draft-model-path", str(tmp_path / "d")]
    p = _run(*common)  # the default: compact, with a cost table profiled on this machine at start-up
    assert p.returncode == 0, p.stderr
    lines = [json.loads(l) for l in p.stdout.strip().splitlines()]
    want = tiny_engine.generate([[5, 6, 7], "def f(x):"], SamplingParams(max_new_tokens=8, ignore_eos=True))
    for got, w in zip(lines, want):
        assert got["token_ids"] == w.token_ids
        assert got["stats"]["spec"]["verify_ct"] >= 1
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"bias_seconds": 1e-3, "bs_probes": [1, 4], "alpha_seconds": [0.0, 1e-4],
                                 "m_probes": [1, 8, 16], "theta_seconds": [0.0, 1e-3, 4e-3]}))
    p = _run(*common, "--sps-min-gain", "-1")
    assert p.returncode == 1 and "--sps-min-gain must be >= 0" in p.stderr
    # Two rounds per dispatch: still the plain engine's greedy tokens (compiled on first use: only
    # the shapes these prompts run); 0 is refused.
    p = _run(*common, "--verify-mode", "compact", "--sps-table-path", str(table), "--rounds-per-call", "2",
             "--no-precompile")
    assert p.returncode == 0, p.stderr
    assert [json.loads(l)["token_ids"] for l in p.stdout.strip().splitlines()] == [w.token_ids for w in want]
    p = _run(*common, "--rounds-per-call", "0")
    assert p.returncode == 1 and "--rounds-per-call must be >= 1" in p.stderr
    p = _run(*common, "--block-size", "7")
    assert p.returncode == 1 and "block size" in p.stderr
    p = _run(*common[:-2])  # no drafter folder and none embedded
    assert p.returncode == 1 and "--draft-model-path" in p.stderr


def test_min_gain_flag_sets_the_schedulers_guard():
    from dspark_jax.server_args import ServerArgs
    from dspark_jax.spec.config import SpeculativeConfig

    resolve = lambda **kw: ServerArgs(speculative_algorithm="DSPARK", **kw).resolve()
    assert resolve().speculative_config().min_predicted_gain == SpeculativeConfig().min_predicted_gain == 0.04
    assert resolve(sps_min_gain=0.0).speculative_config().min_predicted_gain == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        resolve(sps_min_gain=float("nan"))
