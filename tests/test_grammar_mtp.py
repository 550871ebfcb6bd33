"""Structured output under MTP speculation: the chain's drafts, masked step by step, commit the
plain engine's constrained greedy tokens (the DSpark arms: test_grammar_speculative.py)."""

from __future__ import annotations

from tests.test_grammar_speculative import check_arm, constrained  # noqa: F401 (a fixture)


def test_mtp_commits_the_plain_constrained_tokens(target, model_dir, constrained):  # noqa: F811
    check_arm(target, model_dir, constrained, "mtp")
