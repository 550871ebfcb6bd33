"""Sequential Temperature Scaling (STS) of the DSpark confidence head.

The confidence head emits a logit z_k per block position whose sigmoid is the probability that
draft k survives verification given that drafts before it did; the scheduler ranks and budgets
with the cumulative survival Π_{i≤k} σ(z_i).  Training on soft labels leaves that product
miscalibrated, so (paper §3.2.1, SGLang `fit_sts_temperatures`) we fit one temperature per
position, left to right: T_k is the grid value minimising the ECE of the *cumulative* survival
against the realised prefix labels, with T_0..T_{k−1} already fixed.  Temperature scaling is
monotone per position, so it never reorders the per-position confidences.

The calibration file is JSON; only "temperatures" is required ("sts_temperatures", TRT-LLM's
key, is accepted too).  Labels must come from runs that verify the whole block (static or
cap-accept), otherwise positions past the verify window are censored, not rejected.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from dspark_jax.calibration.metrics import DEFAULT_ECE_BINS, expected_calibration_error_rows

TEMPERATURE_KEYS = ("temperatures", "sts_temperatures")


def temperature_grid(low: float = 0.1, high: float = 10.0, num: int = 41) -> np.ndarray:
    """`num` log-spaced temperatures from `low` to `high` (the paper's grid: 0.1..10, 41 points)."""
    if not (0 < low <= high and math.isfinite(high)) or num < 1:
        raise ValueError(f"temperature grid needs 0 < low <= high < inf and num >= 1; got {low}, {high}, {num}")
    return np.logspace(math.log10(low), math.log10(high), int(num))


def sigmoid(x) -> np.ndarray:
    """σ(x) in float64 without overflow for large |x|."""
    return np.exp(-np.logaddexp(0.0, -np.asarray(x, dtype=np.float64)))


def prefix_labels_from_accept_counts(num_accepted_drafts, block_size: int) -> np.ndarray:
    """[n] accepted-draft counts → [n, γ] prefix-survival labels: label[n, k] = 1 iff k < count[n]."""
    counts = np.asarray(num_accepted_drafts)
    if counts.ndim != 1:
        raise ValueError(f"num_accepted_drafts must be 1-D [n]; got shape {counts.shape}")
    if counts.size and (not np.all(counts == np.round(counts)) or counts.min() < 0 or counts.max() > block_size):
        raise ValueError(f"num_accepted_drafts must be integers in [0, {block_size}]")
    return (np.arange(block_size)[None, :] < counts[:, None]).astype(np.int8)


def check_prefix_labels(labels, block_size: int | None = None) -> np.ndarray:
    """Validate [n, γ] prefix labels: 0/1 and non-increasing along each row (no 1 after a 0)."""
    labels = np.asarray(labels)
    if labels.ndim != 2:
        raise ValueError(f"prefix labels must be [n, block_size]; got shape {labels.shape}")
    if block_size is not None and labels.shape[1] != block_size:
        raise ValueError(f"prefix labels have block_size {labels.shape[1]}, expected {block_size}")
    if not np.all((labels == 0) | (labels == 1)):
        raise ValueError("prefix labels must be 0 or 1")
    bad_rows = np.flatnonzero(np.any(np.diff(labels.astype(np.int8), axis=1) > 0, axis=1))
    if bad_rows.size:
        raise ValueError(f"prefix labels must not have a 1 after a 0 (drafts are accepted as a prefix); "
                         f"{bad_rows.size} bad row(s), first: row {bad_rows[0]} = {labels[bad_rows[0]].tolist()}")
    return labels.astype(np.int8)


def _check_logits(logits, block_size: int | None = None) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim < 1 or (block_size is not None and logits.shape[-1] != block_size):
        raise ValueError(f"confidence logits must be [..., {block_size or 'block_size'}]; got shape {logits.shape}")
    if not np.all(np.isfinite(logits)):
        raise ValueError("confidence logits contain NaN or inf")
    return logits


def _parse_temperatures(values: Any, block_size: int | None) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ValueError(f"temperatures must be a list of numbers; got {type(values).__name__}")
    if len(values) == 0:
        raise ValueError("temperatures must not be empty")
    temps = []
    for i, t in enumerate(values):
        if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)):
            raise ValueError(f"temperature {i} is not a number: {t!r}")
        if not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature {i} must be finite and > 0; got {t!r}")
        temps.append(float(t))
    if block_size is not None and len(temps) != block_size:
        raise ValueError(f"calibration has {len(temps)} temperatures but the drafter's block size is {block_size}")
    return tuple(temps)


@dataclass(frozen=True)
class StsCalibration:
    """One temperature per block position; applied as σ(z_k / T_k), survival by cumulative product."""

    temperatures: tuple[float, ...]

    def __post_init__(self):
        object.__setattr__(self, "temperatures", _parse_temperatures(self.temperatures, None))

    @property
    def block_size(self) -> int:
        return len(self.temperatures)

    @classmethod
    def identity(cls, block_size: int) -> StsCalibration:
        """All temperatures 1: the raw confidence head (what data collection must run with)."""
        return cls((1.0,) * block_size)

    @property
    def is_identity(self) -> bool:
        return all(t == 1.0 for t in self.temperatures)

    def confidence(self, logits) -> np.ndarray:
        """Per-position conditional acceptance probability σ(z_k / T_k), for logits [..., γ]."""
        return sigmoid(_check_logits(logits, self.block_size) / np.asarray(self.temperatures))

    def survival(self, logits) -> np.ndarray:
        """Cumulative block survival Π_{i≤k} σ(z_i / T_i), for logits [..., γ]."""
        return np.cumprod(self.confidence(logits), axis=-1)

    def to_dict(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return {"temperatures": list(self.temperatures), **(extra or {})}

    def to_json(self, extra: Mapping[str, Any] | None = None) -> str:
        """JSON text; `extra` adds provenance/metrics keys (NaN is not allowed: use None)."""
        return json.dumps(self.to_dict(extra), indent=2, allow_nan=False)

    @classmethod
    def from_dict(cls, obj: Any, block_size: int | None = None) -> StsCalibration:
        if not isinstance(obj, Mapping):
            raise ValueError(f"STS calibration must be a JSON object; got {type(obj).__name__}")
        present = [k for k in TEMPERATURE_KEYS if k in obj]
        if not present:
            raise ValueError(f"STS calibration has no {' or '.join(map(repr, TEMPERATURE_KEYS))} key")
        if len(present) == 2 and obj[present[0]] != obj[present[1]]:
            raise ValueError("STS calibration has both 'temperatures' and 'sts_temperatures' and they differ")
        return cls(_parse_temperatures(obj[present[0]], block_size))

    @classmethod
    def from_json(cls, text: str, block_size: int | None = None) -> StsCalibration:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"STS calibration is not valid JSON: {e}") from e
        return cls.from_dict(obj, block_size)

    @classmethod
    def load(cls, path: str | Path, block_size: int | None = None) -> StsCalibration:
        """Read a calibration file; `block_size` (the drafter's γ) is checked when given."""
        try:
            return cls.from_json(Path(path).read_text(), block_size)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    def save(self, path: str | Path, extra: Mapping[str, Any] | None = None) -> None:
        Path(path).write_text(self.to_json(extra) + "\n")


@dataclass(frozen=True)
class StsFit:
    """A fitted calibration plus the grid-search objective, kept for diagnostics."""

    calibration: StsCalibration
    grid: np.ndarray
    objective: np.ndarray  # [γ, len(grid)]: ECE of the cumulative survival for each candidate T

    @property
    def at_grid_edge(self) -> list[int]:
        """Positions whose T is the smallest or largest grid value: the grid may be too narrow."""
        lo, hi = self.grid.min(), self.grid.max()
        return [k for k, t in enumerate(self.calibration.temperatures) if t in (lo, hi) and lo != hi]


def _pick_temperature(objective: np.ndarray, grid: np.ndarray) -> int:
    """argmin of the objective; exact ties (to 1e-12) go to the T closest to 1 in log space, then the smaller T."""
    tied = np.flatnonzero(objective <= objective.min() + 1e-12)
    return int(min(tied, key=lambda i: (abs(math.log(grid[i])), grid[i])))


def fit_sts(logits, labels, *, grid=None, num_bins: int = DEFAULT_ECE_BINS, progress: bool = True) -> StsFit:
    """Fit T_0..T_{γ−1} left to right, each minimising the ECE of the cumulative survival.

    logits: raw confidence logits [n, γ] collected with identity temperatures.
    labels: prefix-survival labels [n, γ] (see `prefix_labels_from_accept_counts`).
    grid: candidate temperatures (default `temperature_grid()`).
    """
    logits = _check_logits(logits)
    if logits.ndim != 2 or logits.shape[0] == 0:
        raise ValueError(f"confidence logits must be [n, block_size] with n > 0; got shape {logits.shape}")
    n, block_size = logits.shape
    labels = check_prefix_labels(labels, block_size)
    if labels.shape[0] != n:
        raise ValueError(f"{n} rows of logits but {labels.shape[0]} rows of labels")
    grid = temperature_grid() if grid is None else np.asarray(grid, dtype=np.float64)
    _parse_temperatures(grid.tolist(), None)  # grid values must be valid temperatures

    survival_so_far = np.ones(n)
    temperatures, objective = [], np.empty((block_size, grid.size))
    for k in tqdm(range(block_size), desc="STS fit", unit="pos", delay=1.0, leave=False, disable=not progress):
        candidates = survival_so_far[None, :] * sigmoid(logits[None, :, k] / grid[:, None])  # [G, n]
        objective[k] = expected_calibration_error_rows(candidates, labels[:, k], num_bins)
        best = _pick_temperature(objective[k], grid)
        temperatures.append(float(grid[best]))
        survival_so_far = candidates[best]
    return StsFit(StsCalibration(tuple(temperatures)), grid, objective)
