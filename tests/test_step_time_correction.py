"""The cost table's online level correction: per-probe moving averages, hand-computed."""

from __future__ import annotations

import pytest

from dspark_jax.spec.dspark.step_time_correction import StepTimeCorrection


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
