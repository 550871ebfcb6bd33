"""Online correction of the cost table's level: a moving average of (measured - table) per batch size.

The additive table is profiled with forced budgets and one committed token per request per
step (benchmarks/profile_sps.py), in a separate run.  Serving rounds differ from those in ways the
table cannot see: they commit several tokens per request (detokenizing, stop checks), requests
finish and leave mid-batch, and the host's speed drifts between runs.  When the device is fast
enough that a round is bound by host work, as with the embedded default pair, the table's level
was 20-28% below the measured round time at batch 64 while its shape in K was fine
(benchmarks/results/speculative_default_gpu_bs64.md).

This class learns what is missing from rounds the engine has already read.  Per batch-size probe
of the table (the nearest probe to a round's batch size) it keeps exponential moving averages of
the round's committed tokens ``x`` and residual ``r = measured - table.predict(bs, K)`` (and of
``x^2``, ``x r``), and models the residual as

    r  ~  level_b + c * x          c >= 0: host seconds per committed token, one slope pooled over
                                   probes (sum of the probes' covariances / sum of their variances)

so the offset added to a prediction is ``level_b + c * tau``, with ``tau`` the expected committed
tokens of the budget being priced.  Why the token term: with the default pair at batch 64 a round
committing ~250 tokens took 4.5-7 ms against 3-3.5 ms for the table's one-token rounds, and as the
batch drained the same batch-size bucket saw rounds of 20 tokens: a level alone learned on the
first kept over-predicting the later ones by ~18% (benchmarks/results/
speculative_default_gpu_bs8-64_d8852f2.md).  Without committed-token counts (all zero) the slope
is 0 and the offset is the moving average of the residual, the level-only correction.

The offset is the same for every K up to the token term, so the table's staircase in K stays
intact; the level sets how much a verified token costs *relative to the whole step* (a larger
fixed cost makes trimming worth less), which is exactly what the level error distorted.

Losslessness is untouched: the offset at step t comes from rounds read before step t is planned
and from the lagged survival's expected tokens, never from step t's drafts or their acceptance
(see scheduler.py).
"""

from __future__ import annotations

import numpy as np


class StepTimeCorrection:
    def __init__(self, bs_probes, weight: float = 0.1, max_ratio: float = 1.0):
        """bs_probes: the cost table's batch-size probes (one set of averages per probe).
        weight: the moving averages' weight on a new round, in (0, 1].
        max_ratio: one round's residual is clipped to +-max_ratio x (its table prediction + the
        current offset), so a single stall (a garbage collection, a compile) moves the averages
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
        self.moments = np.zeros((self.bs_probes.size, 4))  # per probe: EMA of x, r, x*x, x*r
        self.rounds = np.zeros(self.bs_probes.size, np.int64)

    def _bucket(self, bs) -> int:
        return int(np.argmin(np.abs(self.bs_probes - float(bs))))

    def per_token_seconds(self) -> float:
        """c: the residual's slope in committed tokens, pooled over probes; >= 0, and 0 until some
        probe has seen rounds with different token counts."""
        mx, mr, mxx, mxr = self.moments[self.rounds > 1].T
        var, cov = float(np.sum(mxx - mx * mx)), float(np.sum(mxr - mx * mr))
        return max(0.0, cov / var) if var > 1e-9 * max(1.0, float(np.sum(mxx))) else 0.0

    @property
    def residual(self) -> np.ndarray:
        """level_b per probe (the offset at zero committed tokens)."""
        return self.moments[:, 1] - self.per_token_seconds() * self.moments[:, 0]

    def offset(self, bs, committed=0.0):
        """Seconds to add to the table's prediction at this batch size for a round committing
        ``committed`` tokens (array-like: one offset each): the level of its probe, or of the
        nearest probe that has seen rounds, plus c x committed; 0 before any round."""
        seen = np.flatnonzero(self.rounds)
        if seen.size == 0:
            return 0.0 if np.ndim(committed) == 0 else np.zeros(np.shape(committed))
        b = self._bucket(bs)
        if not self.rounds[b]:
            b = int(seen[np.argmin(np.abs(seen - b))])
        c = self.per_token_seconds()
        out = self.moments[b, 1] + c * (np.asarray(committed, np.float64) - self.moments[b, 0])
        return float(out) if np.ndim(out) == 0 else out

    def update(self, bs, table_seconds: float, measured_seconds: float, committed: float = 0.0) -> None:
        """Fold one read round: its batch size, the table's raw prediction, the measured time and
        the tokens it committed."""
        b = self._bucket(bs)
        x = float(committed)
        limit = self.max_ratio * (abs(float(table_seconds)) + abs(self.offset(bs, x)))
        r = float(np.clip(float(measured_seconds) - float(table_seconds), -limit, limit))
        new = np.array([x, r, x * x, x * r])
        self.moments[b] = new if self.rounds[b] == 0 else (1 - self.weight) * self.moments[b] + self.weight * new
        self.rounds[b] += 1
