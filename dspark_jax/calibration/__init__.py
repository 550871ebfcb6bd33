"""Confidence calibration for DSpark: Sequential Temperature Scaling and calibration metrics.

Host-side numpy only, so the fitting CLI, the serving engine's observability and tests can use
it without a device.
"""

from dspark_jax.calibration.metrics import (
    DEFAULT_ECE_BINS,
    SGLANG_AUROC_BINS,
    ConfidenceMetricsAccumulator,
    ReliabilityTable,
    auroc,
    auroc_histogram,
    brier_score,
    confidence_metrics_by_position,
    expected_calibration_error,
    expected_calibration_error_rows,
    reliability_table,
)
from dspark_jax.calibration.sts import (
    StsCalibration,
    StsFit,
    check_prefix_labels,
    fit_sts,
    prefix_labels_from_accept_counts,
    sigmoid,
    temperature_grid,
)

__all__ = [
    "DEFAULT_ECE_BINS", "SGLANG_AUROC_BINS", "ConfidenceMetricsAccumulator", "ReliabilityTable", "auroc",
    "auroc_histogram", "brier_score", "confidence_metrics_by_position", "expected_calibration_error",
    "expected_calibration_error_rows", "reliability_table", "StsCalibration", "StsFit", "check_prefix_labels",
    "fit_sts", "prefix_labels_from_accept_counts", "sigmoid", "temperature_grid",
]
