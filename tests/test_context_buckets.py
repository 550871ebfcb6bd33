"""Context buckets: decode steps and speculative rounds run with page tables only as wide as the
smallest bucket that holds their longest request, and commit exactly the tokens of an engine
whose tables are always max_model_len wide."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from dspark_jax.checkpoint import load_model
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.sampling import SamplingParams
from dspark_jax.spec.config import SpeculativeConfig
from dspark_jax.tokenizer import Tokenizer
from tests.test_mtp_engine import repeat_drafter, scaled_target
from tests.test_speculative_engine import TABLE, repeat_biased_drafter

# 256 tokens in pages of 8: 32 pages.  Buckets from 32 tokens: widths 4, 8, 16, 32 pages.
EC = dict(max_running_requests=4, max_prefill_tokens=64, max_model_len=256, page_size=8)
BUCKETED = dict(EC, min_context_bucket=32)
ONE_BUCKET = dict(EC, min_context_bucket=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dspark_jax.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("ctx") / "m", vocab_size=300, max_position_embeddings=512)


def _workload(vocab, seed):
    """Prompts of 1..20 tokens generating 10..150 more: contexts start in the first bucket and
    cross every bucket edge while requests of other lengths share their batches."""
    rng = np.random.default_rng(seed)
    lens = [1, 20, *rng.integers(2, 20, 6)]
    prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in lens]
    params = [SamplingParams(max_new_tokens=int(m), ignore_eos=True) for m in [150, 120, *rng.integers(10, 150, 6)]]
    return prompts, params


def test_page_width_ladder_and_choice(model_dir):
    def widths(**kw):
        return Engine.from_pretrained(model_dir, EngineConfig(**{**EC, "precompile": False, **kw})).page_widths

    assert widths(min_context_bucket=32) == [4, 8, 16, 32]
    assert widths(min_context_bucket=30) == [4, 8, 16, 32]  # rounded up to whole pages
    assert widths(min_context_bucket=32, max_model_len=200) == [4, 8, 16, 25]
    assert widths(min_context_bucket=0) == [32]
    assert widths(min_context_bucket=4096) == [32]  # longer than the context: one bucket
    eng = Engine.from_pretrained(model_dir, EngineConfig(**{**BUCKETED, "precompile": False}))
    assert [eng.page_width(n) for n in (1, 32, 33, 64, 65, 129, 256)] == [4, 4, 8, 8, 16, 32, 32]
    with pytest.raises(ValueError, match="exceeds"):
        eng.page_width(257)
    with pytest.raises(ValueError, match="min_context_bucket"):
        Engine.from_pretrained(model_dir, EngineConfig(**{**EC, "precompile": False, "min_context_bucket": -1}))


def test_plain_decode_runs_narrow_tables_and_commits_the_same_tokens(model_dir, caplog):
    wide = Engine.from_pretrained(model_dir, EngineConfig(**ONE_BUCKET, precompile=False))  # the reference
    eng = Engine.from_pretrained(model_dir, EngineConfig(**BUCKETED))
    assert {key[2] for key in eng.worker._compiled} == {4, 8, 16, 32}  # all compiled at start-up
    prompts, params = _workload(300, seed=0)
    expected = [r.token_ids for r in wide.generate(prompts, params)]
    widths, run = [], eng.worker.run

    def recording(batch, sampling, variant, fn=None):
        widths.append(batch.page_table.shape[1])
        return run(batch, sampling, variant, fn)

    eng.worker.run = recording
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        got = [r.token_ids for r in eng.generate(prompts, params)]
    assert got == expected
    assert not [r.message for r in caplog.records if "Compiling" in r.message]
    assert {4, 8, 16, 32} <= set(widths)  # every bucket served some step


@pytest.mark.parametrize("mode", ["static", "compact"])
def test_dspark_rounds_run_narrow_tables_and_stay_lossless(model_dir, mode):
    _, target = load_model(model_dir)
    tok = Tokenizer.from_folder(model_dir)
    plain = Engine.from_pretrained(model_dir, EngineConfig(**ONE_BUCKET, precompile=False))
    eng = Engine(target, tok, EngineConfig(**BUCKETED, precompile=False), drafter=repeat_biased_drafter(target),
                 spec=SpeculativeConfig(mode=mode, cost_table=TABLE if mode == "compact" else None))
    widths = _spy_widths(eng)
    prompts, params = _workload(300, seed=1)
    assert [r.token_ids for r in eng.generate(prompts, params)] == [r.token_ids for r in plain.generate(prompts, params)]
    assert {8, 16, 32} <= set(widths)  # a round's lookahead (10 tokens here) starts it past 4 pages
    eng.pool.check_invariants()


def test_mtp_rounds_run_narrow_tables_and_stay_lossless():
    target = scaled_target()
    ec = dict(BUCKETED, max_prefill_tokens=16, precompile=False)
    plain = Engine(target, None, EngineConfig(**{**ec, "min_context_bucket": 0}))
    eng = Engine(target, None, EngineConfig(**ec), drafter=repeat_drafter(target),
                 spec=SpeculativeConfig(algorithm="mtp", num_steps=3))
    widths = _spy_widths(eng)
    prompts, params = _workload(128, seed=2)
    assert [r.token_ids for r in eng.generate(prompts, params)] == [r.token_ids for r in plain.generate(prompts, params)]
    assert {4, 8, 16, 32} <= set(widths)
    eng.pool.check_invariants()


def _spy_widths(eng) -> list[int]:
    """The page-table width of every round the engine's worker dispatches, appended as it runs."""
    widths, arrays = [], eng.worker.batch_arrays

    def recording(reqs, S, pages=None):
        out = arrays(reqs, S, pages)
        widths.append(out.table.shape[1])
        return out

    eng.worker.batch_arrays = recording
    return widths
