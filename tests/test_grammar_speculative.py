"""Structured output under speculation: every DSpark verify mode commits the plain engine's
constrained greedy tokens, in a batch that mixes constrained, penalized and free requests (MTP:
test_grammar_mtp.py)."""

from __future__ import annotations

import pytest

from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.tokenizer import Tokenizer
from tests.test_grammar import PROMPTS, _check_matches, _requests
from tests.test_logit_processors import _engine
from tests.tiny_engines import EC


@pytest.fixture(scope="module")
def constrained(model_dir):  # noqa: F811
    params = _requests()
    results = Engine.from_pretrained(model_dir, EngineConfig(**EC)).generate(PROMPTS, params)
    _check_matches(results, params)
    return params, results


def check_arm(target, model_dir, constrained, arm: str) -> None:  # noqa: F811
    """The arm's engine commits the plain engine's tokens, with drafts accepted, in constrained rounds."""
    params, want = constrained
    eng = _engine(target, Tokenizer.from_folder(model_dir), arm, EngineConfig(**EC))
    got = eng.generate(PROMPTS, params)
    for g, w in zip(got, want):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    assert max(a for g in got for a in g.stats["spec"]["accept_lens"]) >= 2  # drafts were committed
    assert any(k[0] == "round" and k[-1] == 2 for k in eng.worker._compiled)  # constrained rounds ran


@pytest.mark.parametrize("arm", ["static", "compact", "cap-accept"])
def test_speculative_arms_commit_the_plain_constrained_tokens(target, model_dir, constrained, arm):  # noqa: F811
    check_arm(target, model_dir, constrained, arm)
