"""Calibration metrics for confidence predictions: ECE, AUROC, Brier and reliability tables.

Everything here is host-side numpy in float64.  The predictions are probabilities in [0, 1]
(for DSpark: the cumulative block survival Π σ(z_i/T_i) at one draft position) and the labels
are the realised outcomes (1 iff the prefix of drafts up to that position was accepted).

Binning convention, shared by ECE, the reliability table and the histogram AUROC: with B
equal-width bins, p falls in bin min(floor(p·B), B−1), i.e. bins are [i/B, (i+1)/B) and the last
bin also holds p = 1.  SGLang's STS fit and confidence probe use B = 15 for ECE; DeepSpec's eval
uses 20.

`auroc` is exact (Mann–Whitney U with tied predictions counted as half a win).  SGLang's probe
instead histograms positives and negatives into 1024 bins so it can stream; `auroc_histogram`
reproduces that (it is the exact AUROC of the binned predictions), and
`ConfidenceMetricsAccumulator` streams all metrics that way for the serving engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_ECE_BINS = 15
SGLANG_AUROC_BINS = 1024


def _check_predictions(pred) -> np.ndarray:
    pred = np.asarray(pred, dtype=np.float64)
    if not np.all(np.isfinite(pred)):
        raise ValueError("predictions contain NaN or inf")
    if pred.size and (pred.min() < 0.0 or pred.max() > 1.0):
        raise ValueError(f"predictions must be probabilities in [0, 1]; got range [{pred.min()}, {pred.max()}]")
    return pred


def _check_labels(label, *, binary: bool) -> np.ndarray:
    label = np.asarray(label, dtype=np.float64)
    if binary and not np.all((label == 0) | (label == 1)):
        raise ValueError("labels must be 0 or 1")
    if not binary and not np.all((label >= 0) & (label <= 1)):
        raise ValueError("labels must lie in [0, 1]")
    return label


def _check_pair(pred, label, *, binary: bool) -> tuple[np.ndarray, np.ndarray]:
    """1-D predictions and labels of equal length; labels in [0, 1], or in {0, 1} when `binary`."""
    pred, label = _check_predictions(pred), _check_labels(label, binary=binary)
    if pred.ndim != 1 or pred.shape != label.shape:
        raise ValueError(f"predictions and labels must be 1-D of equal length; got {pred.shape} and {label.shape}")
    return pred, label


def _check_bins(num_bins: int) -> int:
    if int(num_bins) != num_bins or num_bins < 1:
        raise ValueError(f"num_bins must be a positive integer; got {num_bins!r}")
    return int(num_bins)


def bin_index(pred: np.ndarray, num_bins: int) -> np.ndarray:
    """Equal-width bin of each probability: min(floor(p·B), B−1)."""
    return np.minimum((np.asarray(pred) * num_bins).astype(np.int64), num_bins - 1)


def expected_calibration_error_rows(preds, label, num_bins: int = DEFAULT_ECE_BINS) -> np.ndarray:
    """ECE of each row of `preds` [R, n] against one label vector [n], in one vectorised pass.

    This is what the STS grid search needs: one row per candidate temperature.
    ECE = Σ_bins |mean_pred − mean_label| · count / n.
    """
    num_bins = _check_bins(num_bins)
    preds, label = _check_predictions(preds), _check_labels(label, binary=False)
    if preds.ndim != 2 or label.shape != preds.shape[1:]:
        raise ValueError(f"preds must be [rows, n] and labels [n]; got {preds.shape} and {label.shape}")
    rows, n = preds.shape
    if n == 0:
        return np.full(rows, np.nan)
    flat_bin = (bin_index(preds, num_bins) + num_bins * np.arange(rows)[:, None]).ravel()
    size = rows * num_bins
    sum_pred = np.bincount(flat_bin, weights=preds.ravel(), minlength=size).reshape(rows, num_bins)
    sum_label = np.bincount(flat_bin, weights=np.broadcast_to(label, preds.shape).ravel(),
                            minlength=size).reshape(rows, num_bins)
    # Per bin, |Σpred − Σlabel| / n equals |mean_pred − mean_label| · count / n.
    return np.abs(sum_pred - sum_label).sum(axis=1) / n


def expected_calibration_error(pred, label, num_bins: int = DEFAULT_ECE_BINS) -> float:
    """Expected calibration error with `num_bins` equal-width bins (NaN when there are no samples)."""
    pred, label = _check_pair(pred, label, binary=False)
    return float(expected_calibration_error_rows(pred[None, :], label, num_bins)[0])


def brier_score(pred, label) -> float:
    """Mean squared error between predicted probability and outcome (NaN when empty)."""
    pred, label = _check_pair(pred, label, binary=False)
    return float(np.mean((pred - label) ** 2)) if pred.size else float("nan")


def auroc(pred, label) -> float:
    """Exact AUROC = P(pred_pos > pred_neg) + ½ P(pred_pos == pred_neg), via average ranks.

    NaN when only one class is present (the AUROC is undefined, not 0.5).
    """
    pred, label = _check_pair(pred, label, binary=True)
    num_pos = int(label.sum())
    num_neg = label.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    # Average 1-based rank of each distinct value, so tied predictions share their rank.
    values, inverse, counts = np.unique(pred, return_inverse=True, return_counts=True)
    first_rank = np.cumsum(counts) - counts + 1
    avg_rank = first_rank + (counts - 1) / 2.0
    rank_sum_pos = avg_rank[inverse][label == 1].sum()
    u_statistic = rank_sum_pos - num_pos * (num_pos + 1) / 2.0
    return float(u_statistic / (num_pos * num_neg))


def _auroc_from_histograms(pos_hist: np.ndarray, neg_hist: np.ndarray) -> float:
    num_pos, num_neg = pos_hist.sum(), neg_hist.sum()
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    neg_below = np.cumsum(neg_hist) - neg_hist
    return float((pos_hist * (neg_below + 0.5 * neg_hist)).sum() / (num_pos * num_neg))


def auroc_histogram(pred, label, num_bins: int = SGLANG_AUROC_BINS) -> float:
    """AUROC from per-class histograms (SGLang's streaming probe); same-bin pairs count as ties."""
    pred, label = _check_pair(pred, label, binary=True)
    num_bins = _check_bins(num_bins)
    bins = bin_index(pred, num_bins)
    pos_hist = np.bincount(bins[label == 1], minlength=num_bins).astype(np.float64)
    neg_hist = np.bincount(bins[label == 0], minlength=num_bins).astype(np.float64)
    return _auroc_from_histograms(pos_hist, neg_hist)


@dataclass(frozen=True)
class ReliabilityTable:
    """Per-bin counts and means behind a reliability diagram; empty bins hold NaN means."""

    bin_lower: np.ndarray
    bin_upper: np.ndarray
    count: np.ndarray
    mean_prediction: np.ndarray
    mean_label: np.ndarray

    @property
    def ece(self) -> float:
        total = self.count.sum()
        if total == 0:
            return float("nan")
        gaps = np.nan_to_num(np.abs(self.mean_prediction - self.mean_label))
        return float((gaps * self.count).sum() / total)

    def rows(self) -> list[dict]:
        """Non-empty bins as plain dicts, e.g. for logging or JSON."""
        return [dict(lower=float(lo), upper=float(hi), count=int(c), mean_prediction=float(p), mean_label=float(y))
                for lo, hi, c, p, y in zip(self.bin_lower, self.bin_upper, self.count,
                                           self.mean_prediction, self.mean_label) if c > 0]


def _table_from_sums(count, sum_pred, sum_label) -> ReliabilityTable:
    num_bins = len(count)
    edges = np.arange(num_bins + 1) / num_bins
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.where(count > 0, sum_pred / count, np.nan)
        mean_label = np.where(count > 0, sum_label / count, np.nan)
    return ReliabilityTable(edges[:-1], edges[1:], np.asarray(count, dtype=np.int64), mean_pred, mean_label)


def reliability_table(pred, label, num_bins: int = DEFAULT_ECE_BINS) -> ReliabilityTable:
    """Counts, mean prediction and mean outcome per equal-width bin."""
    pred, label = _check_pair(pred, label, binary=False)
    num_bins = _check_bins(num_bins)
    bins = bin_index(pred, num_bins)
    return _table_from_sums(np.bincount(bins, minlength=num_bins),
                            np.bincount(bins, weights=pred, minlength=num_bins),
                            np.bincount(bins, weights=label, minlength=num_bins))


def _check_block(survival, labels) -> tuple[np.ndarray, np.ndarray]:
    survival, labels = _check_predictions(survival), np.asarray(labels, dtype=np.float64)
    if survival.ndim != 2 or survival.shape != labels.shape:
        raise ValueError(f"survival and labels must both be [n, block_size]; got {survival.shape} and {labels.shape}")
    return survival, labels


def confidence_metrics_by_position(survival, labels, num_bins: int = DEFAULT_ECE_BINS) -> dict[str, list[float]]:
    """Per-position ECE, exact AUROC, Brier, mean prediction and mean label of [n, γ] survival.

    AUROC is NaN at positions where every label is equal (e.g. position 0 always accepted).
    """
    survival, labels = _check_block(survival, labels)
    columns = list(zip(survival.T, labels.T))
    return {
        "ece": [expected_calibration_error(p, y, num_bins) for p, y in columns],
        "auroc": [auroc(p, y) for p, y in columns],
        "brier": [brier_score(p, y) for p, y in columns],
        "mean_prediction": [float(p.mean()) if p.size else float("nan") for p, _ in columns],
        "mean_label": [float(y.mean()) if y.size else float("nan") for _, y in columns],
    }


class ConfidenceMetricsAccumulator:
    """Streams per-position metrics over many steps in O(γ · bins) memory, as SGLang's probe does.

    ECE, Brier and the means are exact; AUROC uses `auroc_bins` per-class histograms
    (equal to `auroc_histogram` over everything seen).  `update` takes [rows, γ] survival and
    {0,1} prefix labels; `summary` returns the same keys as `confidence_metrics_by_position`.

    An engine calls `update` once per round on its host loop, where every microsecond delays the
    next dispatch: an update only checks and keeps its rows, and the histograms fold them in
    batches of at least `fold_rows` rows (one set of bincounts per batch instead of per round),
    and whenever they are read.
    """

    def __init__(self, block_size: int, ece_bins: int = DEFAULT_ECE_BINS, auroc_bins: int = SGLANG_AUROC_BINS,
                 fold_rows: int = 4096):
        self.block_size, self.ece_bins, self.auroc_bins = block_size, _check_bins(ece_bins), _check_bins(auroc_bins)
        self.fold_rows = int(fold_rows)
        self.reset()

    def reset(self) -> None:
        g = self.block_size
        self._count = np.zeros((g, self.ece_bins))
        self._sum_pred = np.zeros((g, self.ece_bins))
        self._sum_label = np.zeros((g, self.ece_bins))
        self._pos_hist = np.zeros((g, self.auroc_bins))
        self._neg_hist = np.zeros((g, self.auroc_bins))
        self._sum_sq_error = np.zeros(g)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_rows = 0

    def update(self, survival, labels) -> None:
        survival = np.array(survival, dtype=np.float64)  # copies: the rows are kept until folded
        labels = np.array(labels)
        if survival.ndim != 2 or survival.shape != labels.shape:
            raise ValueError(f"survival and labels must both be [n, block_size]; got {survival.shape} and {labels.shape}")
        if survival.shape[1] != self.block_size:
            raise ValueError(f"expected block_size {self.block_size}; got {survival.shape[1]}")
        # min / max propagate NaN, which fails both comparisons
        if survival.size and not (survival.min() >= 0.0 and survival.max() <= 1.0):
            raise ValueError("predictions must be finite probabilities in [0, 1]")
        if labels.dtype != np.bool_:
            _check_labels(labels, binary=True)
        self._pending.append((survival, labels))
        self._pending_rows += survival.shape[0]
        if self._pending_rows >= self.fold_rows:
            self._fold()

    def _fold(self) -> None:
        """Add the kept rows to the histograms (every position at once: position k's bins are
        offset by k * bins in one flat bincount)."""
        if not self._pending:
            return
        survival = np.concatenate([s for s, _ in self._pending])
        labels = np.concatenate([y for _, y in self._pending]).astype(np.float64)
        self._pending, self._pending_rows = [], 0
        g = self.block_size
        p, y = survival.ravel(), labels.ravel()
        positive = y == 1
        flat_bins = lambda bins: (bin_index(survival, bins) + np.arange(g) * bins).ravel()
        histogram = lambda idx, bins, weights=None: np.bincount(idx, weights, minlength=g * bins).reshape(g, bins)
        ece_idx, auroc_idx = flat_bins(self.ece_bins), flat_bins(self.auroc_bins)
        self._count += histogram(ece_idx, self.ece_bins)
        self._sum_pred += histogram(ece_idx, self.ece_bins, p)
        self._sum_label += histogram(ece_idx, self.ece_bins, y)
        self._pos_hist += histogram(auroc_idx[positive], self.auroc_bins)
        self._neg_hist += histogram(auroc_idx[~positive], self.auroc_bins)
        self._sum_sq_error += np.sum((survival - labels) ** 2, axis=0)

    def _folded(self, name: str) -> np.ndarray:
        self._fold()
        return getattr(self, name)

    count = property(lambda self: self._folded("_count"))
    sum_pred = property(lambda self: self._folded("_sum_pred"))
    sum_label = property(lambda self: self._folded("_sum_label"))
    pos_hist = property(lambda self: self._folded("_pos_hist"))
    neg_hist = property(lambda self: self._folded("_neg_hist"))
    sum_sq_error = property(lambda self: self._folded("_sum_sq_error"))

    def reliability(self, position: int) -> ReliabilityTable:
        return _table_from_sums(self.count[position], self.sum_pred[position], self.sum_label[position])

    def summary(self) -> dict[str, list[float]]:
        n = self.count.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return {
                "ece": [self.reliability(k).ece for k in range(self.block_size)],
                "auroc": [_auroc_from_histograms(self.pos_hist[k], self.neg_hist[k]) for k in range(self.block_size)],
                "brier": (self.sum_sq_error / n).tolist(),
                "mean_prediction": (self.sum_pred.sum(axis=1) / n).tolist(),
                "mean_label": (self.sum_label.sum(axis=1) / n).tolist(),
            }
