"""Online correction of the cost table's level: a moving average of (measured - table) per batch size.

The additive table is profiled with forced budgets and one committed token per request per
step (benchmarks/profile_sps.py), in a separate run.  Serving rounds differ from those in ways the
table cannot see: they commit several tokens per request (detokenizing, stop checks), requests
finish and leave mid-batch, and the host's speed drifts between runs.  When the device is fast
enough that a round is bound by host work, as with the embedded default pair, the table's level
was 20-28% below the measured round time at batch 64 while its shape in K was fine
(benchmarks/results/speculative_default_gpu_bs64.md).

This class learns the missing level from rounds the engine has already read: for each of the
table's batch-size probes (the nearest probe to a round's batch size) an exponential moving
average of ``measured - table.predict(bs, K)``.  The scheduler adds it to every budget's
prediction.  The offset is the same for every K at a given batch size, so it leaves the table's
staircase in K intact; it only sets how much a verified token costs *relative to the whole step*
(a larger fixed cost makes trimming worth less), which is exactly what the level error distorted.

Losslessness is untouched: the offset at step t comes from rounds read before step t is planned,
never from step t's drafts or their acceptance (see scheduler.py).
"""

from __future__ import annotations

import numpy as np


class StepTimeCorrection:
    def __init__(self, bs_probes, weight: float = 0.1, max_ratio: float = 1.0):
        """bs_probes: the cost table's batch-size probes (one average per probe).
        weight: the moving average's weight on a new round, in (0, 1].
        max_ratio: one round's residual is clipped to +-max_ratio x (its table prediction + the
        current correction), so a single stall (a garbage collection, a compile) moves the average
        by a bounded amount while a level far off the table is still reached over a few rounds."""
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if not max_ratio > 0:
            raise ValueError(f"max_ratio must be > 0, got {max_ratio}")
        self.bs_probes = np.asarray(bs_probes, dtype=np.float64).reshape(-1)
        if self.bs_probes.size == 0:
            raise ValueError("bs_probes is empty")
        self.weight = float(weight)
        self.max_ratio = float(max_ratio)
        self.residual = np.zeros(self.bs_probes.size)
        self.rounds = np.zeros(self.bs_probes.size, np.int64)
        self._buckets: dict = {}  # batch size -> its probe (the engine asks every round)

    def _bucket(self, bs) -> int:
        b = self._buckets.get(bs)
        if b is None:
            b = self._buckets[bs] = int(np.argmin(np.abs(self.bs_probes - float(bs))))
        return b

    def offset(self, bs) -> float:
        """Seconds to add to the table's prediction at this batch size: the average of its
        probe, or of the nearest probe that has seen rounds; 0 before any round."""
        b = self._bucket(bs)
        if self.rounds[b]:
            return float(self.residual[b])
        seen = np.flatnonzero(self.rounds)
        if seen.size == 0:
            return 0.0
        return float(self.residual[int(seen[np.argmin(np.abs(seen - b))])])

    def update(self, bs, table_seconds: float, measured_seconds: float) -> None:
        """Fold one read round: its batch size, the table's raw prediction, the measured time.
        (Scalar arithmetic in Python: the engine calls this every round of a host-paced loop.)"""
        b = self._bucket(bs)
        old = float(self.residual[b])
        limit = self.max_ratio * (abs(float(table_seconds)) + abs(old))
        r = min(max(float(measured_seconds) - float(table_seconds), -limit), limit)
        self.residual[b] = r if self.rounds[b] == 0 else (1 - self.weight) * old + self.weight * r
        self.rounds[b] += 1
