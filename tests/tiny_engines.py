"""Engines the logit-processor and grammar tests share: a 300-token checkpoint written by
transformers with its plain engine, and the three engines (plain, DSpark static, MTP) whose sampled
tokens the distribution tests compare with a reference law."""

from __future__ import annotations

import pytest

from dspark_jax.checkpoint import load_model
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.spec.config import SpeculativeConfig

EC = dict(max_running_requests=4, max_prefill_tokens=64, max_model_len=256, page_size=8, precompile=False)
SAMPLING_ARMS = ("plain", "static", "mtp")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dspark_jax.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", vocab_size=300, max_position_embeddings=512)


@pytest.fixture(scope="module")
def target(model_dir):
    return load_model(model_dir)[1]


@pytest.fixture(scope="module")
def plain(model_dir):
    return Engine.from_pretrained(model_dir, EngineConfig(**EC))


def sampling_engine(target, arm: str) -> Engine:
    """An engine for thousands of short seeded requests: plain decoding, DSpark static with a drafter
    biased to repeat the last token (drafts both accepted and rejected), or MTP drafting repeats."""
    from tests.test_mtp_engine import repeat_drafter
    from tests.test_speculative_engine import repeat_biased_drafter

    ec = EngineConfig(max_running_requests=64, max_prefill_tokens=256, max_prefill_seqs=64, max_model_len=64,
                      page_size=4, precompile=False)
    if arm == "plain":
        return Engine(target, None, ec)
    if arm == "static":
        return Engine(target, None, ec, drafter=repeat_biased_drafter(target, gamma=3, strength=2.0),
                      spec=SpeculativeConfig(mode="static"))
    if arm == "mtp":
        return Engine(target, None, ec, drafter=repeat_drafter(target), spec=SpeculativeConfig(algorithm="mtp", num_steps=2))
    raise ValueError(f"unknown arm {arm!r}; choose from {SAMPLING_ARMS}")
