"""The serving gauges' tokens/s over a window (dspark_jax/token_rate.py), on hand-timed commits."""

from __future__ import annotations

import pytest

from dspark_jax.token_rate import TokenRate


def test_rate_counts_tokens_after_the_first_commit_and_forgets_old_ones():
    rate = TokenRate(window_s=2.0)
    assert rate.per_second(now=0.0) == 0.0
    rate.add(8, now=10.0)
    assert rate.per_second(now=10.0) == 0.0  # one commit: no span yet
    rate.add(4, now=10.5)
    rate.add(6, now=11.0)
    assert rate.per_second(now=11.0) == pytest.approx((4 + 6) / 1.0)
    assert rate.per_second(now=12.2) == pytest.approx(6 / 0.5)  # the commit at 10.0 left the window
    assert rate.per_second(now=13.1) == 0.0  # idle: every commit aged out
