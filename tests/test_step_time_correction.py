"""The cost table's online level correction: per-probe moving averages, hand-computed."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.speculative.step_time_correction import StepTimeCorrection


def test_moving_average_per_batch_size_probe():
    c = StepTimeCorrection([1, 8, 64], weight=0.25)
    assert c.offset(64) == 0.0  # nothing measured yet
    c.update(64, table_seconds=3e-3, measured_seconds=4e-3)  # first round of a probe: taken as is
    assert c.offset(64) == pytest.approx(1e-3)
    c.update(60, table_seconds=3e-3, measured_seconds=5e-3)  # nearest probe 64
    assert c.offset(64) == pytest.approx(0.75 * 1e-3 + 0.25 * 2e-3)
    # An unseen probe borrows the nearest probe that has rounds; then learns its own.
    assert c.offset(8) == c.offset(64) and c.offset(1) == c.offset(64)
    c.update(7, table_seconds=2e-3, measured_seconds=1.5e-3)
    assert c.offset(8) == pytest.approx(-0.5e-3)
    assert c.offset(1) == pytest.approx(-0.5e-3)  # nearest seen probe is now 8
    assert c.offset(64) == pytest.approx(1.25e-3)


def test_a_single_stall_moves_the_average_a_bounded_amount():
    c = StepTimeCorrection([16], weight=0.5, max_ratio=1.0)
    c.update(16, table_seconds=2e-3, measured_seconds=1.0)  # a 1 s stall: clipped to +2 ms
    assert c.offset(16) == pytest.approx(2e-3)
    c.update(16, table_seconds=2e-3, measured_seconds=1.0)  # limit grows with the estimate: 4 ms
    assert c.offset(16) == pytest.approx(0.5 * 2e-3 + 0.5 * 4e-3)
    c.update(16, table_seconds=2e-3, measured_seconds=0.0)  # faster than the table: clipped below too
    assert c.offset(16) == pytest.approx(0.5 * 3e-3 + 0.5 * -2e-3)


@pytest.mark.parametrize("kw", [{"weight": 0.0}, {"weight": 1.5}, {"max_ratio": 0.0}])
def test_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        StepTimeCorrection([1, 2], **kw)
    with pytest.raises(ValueError):
        StepTimeCorrection([])


def test_committed_token_slope_is_pooled_within_batch_size_probes():
    # residual = level_b + c * x with c = 10 us per committed token; the level of the larger batch
    # is higher AND its rounds commit more, so a slope fitted across probes would be biased (here
    # it would come out far above c); pooled within probes it is exact.
    c_true, levels = 1e-5, {8: 2e-4, 64: 1.5e-3}
    corr = StepTimeCorrection([8, 64], weight=1.0)  # weight 1: the averages are the last round
    corr.update(8, 2e-3, 2e-3 + levels[8] + c_true * 10, committed=10)
    assert corr.per_token_seconds() == 0.0  # one round: no slope yet
    assert corr.offset(8, 10) == pytest.approx(levels[8] + c_true * 10)
    rng = np.random.default_rng(0)
    corr = StepTimeCorrection([8, 64], weight=0.2)
    for _ in range(200):
        bs = int(rng.choice([8, 64]))
        x = float(rng.integers(8, 40) if bs == 8 else rng.integers(150, 300))
        corr.update(bs, 3e-3, 3e-3 + levels[bs] + c_true * x, committed=x)
    assert corr.per_token_seconds() == pytest.approx(c_true, rel=1e-6)
    for bs in (8, 64):
        assert corr.residual[corr._bucket(bs)] == pytest.approx(levels[bs], rel=1e-6)
        np.testing.assert_allclose(corr.offset(bs, np.array([0.0, 100.0])),
                                   [levels[bs], levels[bs] + c_true * 100], rtol=1e-6)


def test_a_negative_token_slope_is_clipped_to_zero():
    corr = StepTimeCorrection([16], weight=0.5)
    for x in (10, 50, 10, 50, 10, 50):
        corr.update(16, 3e-3, 3e-3 - 1e-5 * x, committed=x)  # faster when committing more: noise, not cost
    assert corr.per_token_seconds() == 0.0
    assert corr.offset(16, 1000) == corr.offset(16, 0)
