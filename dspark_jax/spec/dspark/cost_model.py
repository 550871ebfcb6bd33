"""Additive step-time model T(bs, K) = bias + alpha(bs) + theta(bs + K), and its least-squares fit.

The confidence scheduler trades expected committed tokens against predicted step time, so it
needs the time of one speculative step as a function of the batch size ``bs`` (running requests)
and the budget ``K`` (verify tokens beyond each request's anchor; ``M = bs + K`` tokens are
verified in all).  The additive model splits that time into

* ``alpha(bs)``: the request-count floor (draft forward, per-request attention and bookkeeping),
  which trimming cannot touch;
* ``theta(M)``: the verify-token cost, the only term a smaller budget recovers;
* ``bias``: everything constant.

Both curves are categorical tables read with piecewise-linear interpolation, not a parametric
fit: on an XLA backend the verify step runs the executable of a token *tier*, so ``theta`` is a
staircase whose risers sit at tier boundaries, and a smooth curve would hide exactly the cliffs
the scheduler must see.

Clamping.  Lookups use ``np.interp`` semantics: between probes the value is linear, outside the
probe range it is the nearest end value (flat extrapolation).  A table profiled only up to some
M therefore makes every larger M cost the same as the largest probe; that errs towards verifying
more, never towards trimming on the strength of an extrapolated slope.

No table (``None``) means "verify all": the scheduler then skips the argmax and returns the full
budget, which is what compact mode must do before a profile exists (every extra token looks
free).

The JSON file holds the keys ``bias_seconds, bs_probes, alpha_seconds, m_probes,
theta_seconds`` (the format SGLang's additive SPS table uses) and optionally ``decode_bs_probes,
decode_seconds``: the time of a plain decode step (one token per request, no drafting) by batch
size, which lets the scheduler run plain steps when no speculative window pays.  Loading
validates it and says what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from dspark_jax.errors import DsparkError, read_json

TABLE_KEYS = ("bias_seconds", "bs_probes", "alpha_seconds", "m_probes", "theta_seconds")
DECODE_KEYS = ("decode_bs_probes", "decode_seconds")


class CostTableError(DsparkError, ValueError):
    """A cost table (or the samples to fit one) is malformed; the message names the field."""


def _probe_curve(name_x: str, xs, name_y: str, ys) -> tuple[np.ndarray, np.ndarray]:
    """Validate one (probes, values) curve and return read-only float64 copies."""
    try:
        x = np.asarray(xs, dtype=np.float64)
        y = np.asarray(ys, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise CostTableError(f"{name_x}/{name_y} must be lists of numbers: {e}") from None
    if x.ndim != 1 or y.ndim != 1:
        raise CostTableError(f"{name_x} and {name_y} must be flat lists, got shapes {x.shape} and {y.shape}")
    if x.size == 0:
        raise CostTableError(f"{name_x} is empty: a curve needs at least one probe")
    if x.size != y.size:
        raise CostTableError(f"{name_x} has {x.size} probes but {name_y} has {y.size} values; they must match")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise CostTableError(f"{name_x} and {name_y} must be finite (no NaN or inf)")
    if np.any(x < 0):
        raise CostTableError(f"{name_x} must be >= 0, got {x.tolist()}")
    if np.any(np.diff(x) <= 0):
        raise CostTableError(f"{name_x} must be strictly increasing, got {x.tolist()}")
    x.flags.writeable = False
    y.flags.writeable = False
    return x, y


@dataclasses.dataclass(frozen=True, eq=False)
class AdditiveCostTable:
    """Step time in seconds: ``bias + alpha(bs) + theta(bs + K)`` with clamped linear lookups."""

    bias_seconds: float
    bs_probes: np.ndarray
    alpha_seconds: np.ndarray
    m_probes: np.ndarray
    theta_seconds: np.ndarray
    decode_bs_probes: np.ndarray | None = None  # plain decode step time by batch size (optional)
    decode_seconds: np.ndarray | None = None

    def __post_init__(self):
        bias = float(self.bias_seconds)
        if not math.isfinite(bias):
            raise CostTableError(f"bias_seconds must be finite, got {self.bias_seconds!r}")
        bs, alpha = _probe_curve("bs_probes", self.bs_probes, "alpha_seconds", self.alpha_seconds)
        m, theta = _probe_curve("m_probes", self.m_probes, "theta_seconds", self.theta_seconds)
        # Interpolation never leaves [min, max] of the probe values, so this bound is the smallest
        # time the table can ever predict; the throughput ratio tau / T needs it positive.
        floor = bias + alpha.min() + theta.min()
        if not floor > 0:
            raise CostTableError(
                f"the table can predict a non-positive step time ({floor:.3g} s = bias + min alpha + min theta); "
                "a step always takes time, so the fit or the file is wrong"
            )
        object.__setattr__(self, "bias_seconds", bias)
        object.__setattr__(self, "bs_probes", bs)
        object.__setattr__(self, "alpha_seconds", alpha)
        object.__setattr__(self, "m_probes", m)
        object.__setattr__(self, "theta_seconds", theta)
        if (self.decode_bs_probes is None) != (self.decode_seconds is None):
            raise CostTableError("decode_bs_probes and decode_seconds come together")
        if self.decode_bs_probes is not None:
            db, ds = _probe_curve("decode_bs_probes", self.decode_bs_probes, "decode_seconds", self.decode_seconds)
            if not ds.min() > 0:
                raise CostTableError(f"decode_seconds must be > 0, got {ds.tolist()}")
            object.__setattr__(self, "decode_bs_probes", db)
            object.__setattr__(self, "decode_seconds", ds)

    # -- lookup -------------------------------------------------------------------------
    @property
    def prices_budget(self) -> bool:
        """Whether the verify budget K moves a prediction at all.  A loop the host paces profiles
        flat (benchmarks/results/sps_table_gpu_t1_r2_bs64_9b65b74.md: theta 0 at every probe):
        then every K costs the same and no trim can raise tau(K) / T above verify-all."""
        return bool(np.ptp(self.theta_seconds) > 0)

    @property
    def prices_decode(self) -> bool:
        """Whether the table knows what a plain decode step costs (so a round can be one)."""
        return self.decode_bs_probes is not None

    def predict_decode(self, bs) -> float:
        """Predicted seconds of a plain decode step of ``bs`` requests (clamped linear lookup)."""
        if self.decode_bs_probes is None:
            raise CostTableError("this table has no decode probes")
        return float(np.interp(bs, self.decode_bs_probes, self.decode_seconds))

    def with_decode(self, bs_probes, seconds) -> AdditiveCostTable:
        """This table with the given plain-decode curve."""
        return dataclasses.replace(self, decode_bs_probes=bs_probes, decode_seconds=seconds)

    def alpha(self, bs):
        return np.interp(bs, self.bs_probes, self.alpha_seconds)

    def theta(self, num_tokens):
        return np.interp(num_tokens, self.m_probes, self.theta_seconds)

    def predict(self, bs, budget):
        """Predicted seconds of one step with ``bs`` requests and ``budget`` extra verify tokens.

        Broadcasts: ``predict(bs, np.arange(k_max + 1))`` prices every budget at once.  Returns a
        Python float when both arguments are scalars."""
        bs_arr = np.asarray(bs, dtype=np.float64)
        m = bs_arr + np.asarray(budget, dtype=np.float64)
        out = self.bias_seconds + self.alpha(bs_arr) + self.theta(m)
        return float(out) if np.ndim(out) == 0 else out

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {
            "bias_seconds": self.bias_seconds,
            "bs_probes": self.bs_probes.tolist(),
            "alpha_seconds": self.alpha_seconds.tolist(),
            "m_probes": self.m_probes.tolist(),
            "theta_seconds": self.theta_seconds.tolist(),
        }
        if self.prices_decode:
            out.update(decode_bs_probes=self.decode_bs_probes.tolist(), decode_seconds=self.decode_seconds.tolist())
        return out

    @classmethod
    def from_dict(cls, data: dict) -> AdditiveCostTable:
        if not isinstance(data, dict):
            raise CostTableError(f"a cost table is a JSON object, got {type(data).__name__}")
        missing = [k for k in TABLE_KEYS if k not in data]
        extra = sorted(set(data) - set(TABLE_KEYS) - set(DECODE_KEYS))
        if missing or extra:
            raise CostTableError(
                f"cost table keys must be {list(TABLE_KEYS)} (and optionally {list(DECODE_KEYS)}); "
                f"missing {missing}, unexpected {extra}"
            )
        bias = data["bias_seconds"]
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise CostTableError(f"bias_seconds must be a number, got {bias!r}")
        for key in TABLE_KEYS[1:] + tuple(k for k in DECODE_KEYS if k in data):
            if not isinstance(data[key], list) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                                      for v in data[key]):
                raise CostTableError(f"{key} must be a list of numbers, got {data[key]!r}")
        return cls(**{k: data[k] for k in TABLE_KEYS + DECODE_KEYS if k in data})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> AdditiveCostTable:
        data = read_json(path, "cost table", CostTableError)
        try:
            return cls.from_dict(data)
        except CostTableError as e:
            raise CostTableError(f"{path}: {e}") from None


def load_cost_table(path: str | Path | None) -> AdditiveCostTable | None:
    """The table at ``path``, or ``None`` (verify all) when no path is given."""
    return None if path is None else AdditiveCostTable.load(path)


# -- least-squares fit (used by the profiler) --------------------------------------------


def m_bin_of(num_tokens, m_bin: int = 64):
    """Representative of the M bin: the nearest multiple of ``m_bin``, halves rounded up."""
    return np.floor(np.asarray(num_tokens, dtype=np.float64) / m_bin + 0.5) * m_bin


@dataclasses.dataclass(frozen=True, eq=False)
class CostFit:
    """A fitted table plus the diagnostics the profiler reports."""

    table: AdditiveCostTable
    predicted_seconds: np.ndarray  # per sample, in input order
    residual_seconds: np.ndarray  # measured - predicted
    rms_seconds: float
    r_squared: float  # nan when every sample has the same time
    rank: int
    num_params: int  # 1 + (#bs - 1) + (#M bins - 1)
    bias_std_error: float  # nan when there are no spare degrees of freedom
    alpha_std_errors: np.ndarray  # per bs probe; 0 for the baseline
    theta_std_errors: np.ndarray  # per M probe; 0 for the baseline

    @property
    def rank_deficient(self) -> bool:
        return self.rank < self.num_params


def _isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return np.concatenate([np.full(n, v) for v, _, n in blocks])


def _monotone_refit(seconds, bs_idx, m_idx, nb, nm, coef, iters: int = 500) -> np.ndarray:
    """Least squares with alpha non-decreasing in bs and theta non-decreasing in M.

    Block coordinate descent from the OLS solution: alternately the best non-decreasing
    ``bias + alpha`` per batch size given theta, and the best non-decreasing theta per M bin given
    those (each a weighted isotonic regression of group means), theta re-based so its first bin is
    0.  Both blocks are convex and the constraints separate, so this converges to the constrained
    optimum."""
    counts_b = np.bincount(bs_idx, minlength=nb).astype(float)
    counts_m = np.bincount(m_idx, minlength=nm).astype(float)
    level = coef[0] + np.concatenate([[0.0], coef[1:nb]])  # bias + alpha_b
    theta = np.concatenate([[0.0], coef[nb:]])
    for _ in range(iters):
        prev = np.concatenate([level, theta])
        level = _isotonic(np.bincount(bs_idx, seconds - theta[m_idx], nb) / counts_b, counts_b)
        full = _isotonic(np.bincount(m_idx, seconds - level[bs_idx], nm) / counts_m, counts_m)
        theta, level = full - full[0], level + full[0]
        if np.max(np.abs(np.concatenate([level, theta]) - prev)) < 1e-15:
            break
    return np.concatenate([[level[0]], level[1:] - level[0], theta[1:]])


def fit_additive_cost(samples: Iterable[Sequence[float]], m_bin: int = 64, monotone: bool = False) -> CostFit:
    """OLS fit of ``T = bias + sum_b 1[bs=b] alpha_b + sum_m 1[bin(M)=m] theta_m``.

    ``monotone``: constrain alpha to be non-decreasing in the batch size and theta in M (a round
    with more requests or more verify tokens never costs less).  Profiled step times of a small,
    latency-bound model are nearly flat in M, and unconstrained noise then puts dips into theta
    that the scheduler reads as savings from trimming; the constrained fit pools them instead.  The
    standard errors are the OLS formula's (the design's covariance) with the constrained residuals.

    ``samples`` are ``(bs, M, seconds)`` cells (repeats allowed).  The smallest batch size and
    the smallest M bin are the zero baselines, so alpha and theta are relative to them and bias is
    the time of that corner cell.  The probes are the distinct batch sizes and M-bin
    representatives seen.  A design that cannot separate alpha from theta (e.g. only verify-all
    cells, where every bs has its own M) is rank deficient: ``lstsq`` then returns the minimum-norm
    solution, which still fits the sampled cells but splits the time between alpha and theta
    arbitrarily, and a ``RuntimeWarning`` says so.
    """
    if m_bin < 1:
        raise CostTableError(f"m_bin must be >= 1, got {m_bin}")
    rows = np.asarray([tuple(s) for s in samples], dtype=np.float64)
    if rows.size == 0:
        raise CostTableError("no samples to fit")
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise CostTableError("each sample must be (bs, M, seconds)")
    if not np.all(np.isfinite(rows)):
        raise CostTableError("samples must be finite")
    bs, m, seconds = rows.T
    if np.any(bs < 1) or np.any(bs != np.round(bs)):
        raise CostTableError("sample batch sizes must be integers >= 1")
    if np.any(m < bs):
        raise CostTableError("a sample's M (verify tokens) cannot be below its batch size: each request verifies its anchor")
    if np.any(seconds <= 0):
        raise CostTableError("sample step times must be > 0 seconds")

    mbins = m_bin_of(m, m_bin)
    bs_probes, bs_idx = np.unique(bs, return_inverse=True)
    m_probes, m_idx = np.unique(mbins, return_inverse=True)
    nb, nm, n = bs_probes.size, m_probes.size, rows.shape[0]
    num_params = 1 + (nb - 1) + (nm - 1)

    design = np.zeros((n, num_params))
    design[:, 0] = 1.0
    sel = bs_idx > 0
    design[np.flatnonzero(sel), bs_idx[sel]] = 1.0  # columns 1..nb-1
    sel = m_idx > 0
    design[np.flatnonzero(sel), nb - 1 + m_idx[sel]] = 1.0  # columns nb..nb+nm-2

    coef, _, rank, _ = np.linalg.lstsq(design, seconds, rcond=None)
    rank = int(rank)
    if rank < num_params:
        warnings.warn(
            f"cost fit is rank deficient ({rank} of {num_params} parameters identifiable): the samples do not "
            "separate alpha(bs) from theta(M); add cells with several budgets per batch size",
            RuntimeWarning,
            stacklevel=2,
        )
    if monotone:
        coef = _monotone_refit(seconds, bs_idx, m_idx, nb, nm, coef)
    predicted = design @ coef
    resid = seconds - predicted
    ss_res = float(resid @ resid)
    centred = seconds - seconds.mean()
    ss_tot = float(centred @ centred)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")
    dof = n - rank
    if dof > 0:
        cov = (ss_res / dof) * np.linalg.pinv(design.T @ design)
        se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    else:
        se = np.full(num_params, np.nan)

    table = AdditiveCostTable(
        bias_seconds=float(coef[0]),
        bs_probes=bs_probes,
        alpha_seconds=np.concatenate([[0.0], coef[1:nb]]),
        m_probes=m_probes,
        theta_seconds=np.concatenate([[0.0], coef[nb:]]),
    )
    return CostFit(
        table=table,
        predicted_seconds=predicted,
        residual_seconds=resid,
        rms_seconds=math.sqrt(ss_res / n),
        r_squared=r2,
        rank=rank,
        num_params=num_params,
        bias_std_error=float(se[0]),
        alpha_std_errors=np.concatenate([[0.0], se[1:nb]]),
        theta_std_errors=np.concatenate([[0.0], se[nb:]]),
    )


def fit_additive_table(samples: Iterable[Sequence[float]], m_bin: int = 64, monotone: bool = False) -> AdditiveCostTable:
    """The table of ``fit_additive_cost`` (use that function for residuals and R^2)."""
    return fit_additive_cost(samples, m_bin, monotone).table
