"""The cost table's online level correction: per-probe moving averages, hand-computed."""

from __future__ import annotations

import numpy as np
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


def test_replay_follows_the_engine_timing_hand_computed():
    """benchmarks/replay_step_time_correction.py: an overlapped round is predicted before the
    round ahead of it is read, a synchronous one after (weight 1: the level is the last residual)."""
    from benchmarks.replay_step_time_correction import replay

    table, measured = [1.0] * 4, [2.0, 3.0, 4.0, 9.0]
    pred = replay(table, measured, [8] * 4, [True, True, True, False], [8], weight=1.0, per_regime=False)
    # round 0: nothing learned; 1: round 0 not read yet; 2: round 0's residual 1; 3 (synchronous):
    # round 2's residual 3 (clipped to table + level = 1 + 2, it is exactly 3)
    assert pred.tolist() == [1.0, 1.0, 2.0, 4.0]


def test_replay_per_regime_separates_overlapped_and_synchronous_levels():
    """Rounds alternating between 1.4 ms (overlapped) and 2.4 ms (synchronous) over a 1 ms table:
    one level misses every round by ~25-40%, one per regime converges on both (the synchronous
    level's first residual is clipped to the table's 1 ms, then approached at weight 0.3)."""
    from benchmarks.replay_step_time_correction import median_rel_error, replay

    n = 40
    ov = np.arange(n) % 2 == 0
    measured = np.where(ov, 1.4e-3, 2.4e-3)
    table, bs = np.full(n, 1e-3), np.full(n, 64)
    one = median_rel_error(replay(table, measured, bs, ov, [64], 0.3, per_regime=False), measured)
    two = median_rel_error(replay(table, measured, bs, ov, [64], 0.3, per_regime=True), measured)
    assert one > 0.2 and two < 0.01
