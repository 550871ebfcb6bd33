"""Goodness of fit for sampled outputs: the tests' shared chi-square check."""

from __future__ import annotations

import numpy as np


def assert_counts_fit(counts: np.ndarray, expected: np.ndarray) -> None:
    """Chi-square of observed `counts` against `expected` (same shape), cells expected below 5
    pooled into one, below the normal approximation of the 99.9% quantile, dof + 3.1 sqrt(2 dof)."""
    keep = expected >= 5
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum() + \
        (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(expected[~keep].sum(), 1)
    dof = keep.sum()
    assert chi2 < dof + 3.1 * np.sqrt(2 * dof), (chi2, dof)
