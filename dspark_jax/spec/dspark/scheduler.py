"""Confidence scheduler: how many draft tokens to verify per step, and whose.

The decision has two parts (DSpark paper section 5.2, SGLang's planner):

1. **Batch budget K** (extra verify tokens beyond each request's anchor), chosen on the host from
   survival observed ``lag`` steps ago (default 2).  With ``a_1 >= a_2 >= ...`` the lagged
   survivals of all (request, position) pairs, fresh or recycled slots counting 1 everywhere::

       tau(n) = R + a_1 + ... + a_n        expected committed tokens (one bonus per request)
       T(n)   = table.predict(R, n)      predicted step seconds
       K      = argmax over n = 0..#candidates of tau(n) / T(n)

   The argmax is global: tiers make the cost a staircase, so tau/T is not unimodal and a greedy
   walk that stops at the first dip would never cross a riser to the better plateau beyond it.
   Exact ties go to the smaller n (``np.argmax``, as SGLang): same predicted throughput for less
   device work.  Without a cost table K = R * gamma, i.e. verify everything.  A table that also
   prices a plain decode step (one token per request, no drafting) makes the round a plain step
   when R / T_decode(R) beats the best speculative throughput: speculation never runs where it
   is predicted to lose.

2. **Per-request lengths**: the global top-K of the *current* step's survival, ranked by value,
   ties broken by position and then request index (never by value, so the rule is the same for
   any data).  Survival is a cumulative product of confidences in [0, 1], hence non-increasing
   along a row; with ties going to the lower position, a row's position j can only be chosen if
   every earlier position of that row was, so each request's selection is a prefix and its
   verify length ``1 + count`` is a valid window.

Why trimming stays lossless.  Speculative sampling is exact whatever the verify lengths, as long
as the decision to verify draft ``x_{r,j}`` does not depend on ``x_{r,j}`` itself or on anything
after it; above all no decision may depend on whether step t's drafts will be *accepted*, i.e. on
the target's outputs.  The target has not run when these decisions are made, and:

* K, and therefore the compiled tier, is computed only from data of step ``t - lag``; it is
  independent of everything drafted at step t.
* The allocation does use step t's confidence, which the drafter computes from its own draft (the
  sequential head feeds the previous draft token into position j's confidence).  But whether
  (r, j) is in the top K depends only on ``s_{r,1..j}`` and on other requests: later positions of
  row r rank below it (smaller or equal value, later position).  ``s_{r,j}`` is built from
  ``x_{r,<j}``, so the verify decision for ``x_{r,j}`` is a stopping rule over the drafts before
  it.  What would break this is a budget taken from the current survival (a global argmax over
  step t's confidence), where admitting ``x_{r,j}`` could hinge on ``c_{r,j+1}``, a function of
  ``x_{r,j}`` (the paper's appendix A counterexample); hence the lag.

The lag ring.  Survival reaches the host asynchronously, so the budget of step t reads, for
each request, the latest survival observed at step ``t - lag`` or before (a plain decode step
observes none, so a request keeps its last speculative round's).  Rows are keyed by slot (an
index into the fixed max-batch arrays) and the request's generation id in that slot: a slot
recycled for a new request, a slot never observed, a negative generation (empty slot) or fewer
than ``lag`` observed steps all read as fresh, survival 1 (optimistic: a new request never
inherits another one's confidence).

Everything here is numpy on the host; a step at R = 256, gamma = 7 costs well under a
millisecond (argpartition for the top-K, one sort for the budget).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import NamedTuple

import numpy as np

from dspark_jax.spec.dspark.cost_model import AdditiveCostTable

SURVIVAL_EPS = 1e-6  # lagged survivals below this are not budget candidates (as SGLang)


@dataclasses.dataclass(frozen=True)
class BudgetDecision:
    budget: int  # K: verify tokens beyond the anchors, in [0, R * gamma]
    num_candidates: int  # lagged survivals >= SURVIVAL_EPS (the argmax range is 0..this)
    expected_tokens: float  # tau(K) on the lagged survival
    predicted_step_seconds: float | None  # T(R, K); None without a table
    predicted_tokens_per_second: float | None  # tau(K) / T(R, K)
    guard_applied: bool = False  # the min-gain guard overrode the argmax with verify-all
    decode: bool = False  # a plain decode step (no drafting) beats every speculative budget


@dataclasses.dataclass(frozen=True, eq=False)
class StepRecord:
    """What one step decided, for logs and metrics."""

    step: int
    batch_size: int
    budget: int
    verify_lens: np.ndarray  # [R] int32, anchor included, in 1..gamma+1
    expected_tokens: float
    predicted_step_seconds: float | None
    guard_applied: bool


class LaggedSurvival(NamedTuple):
    survival: np.ndarray  # [R, gamma] float; 1.0 on fresh rows
    fresh: np.ndarray  # [R] bool


def _survival_matrix(survival, block_size: int, what: str) -> np.ndarray:
    s = np.asarray(survival)
    if s.ndim != 2 or s.shape[1] != block_size:
        raise ValueError(f"{what} must have shape [R, {block_size}], got {s.shape}")
    if not np.all((s >= 0) & (s <= 1)):  # one pass; NaN fails both comparisons
        raise ValueError(f"{what} must be finite probabilities in [0, 1]")
    return s


class ConfidenceScheduler:
    def __init__(self, block_size: int, cost_table: AdditiveCostTable | None, lag: int = 2,
                 min_predicted_gain: float | None = None):
        """block_size: gamma.  cost_table: None means verify all.  lag: steps between the
        survival a budget uses and the step it is for (>= 1; see module doc).
        min_predicted_gain: g >= 0; trim only if predicted throughput beats verify-all by (1 + g)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if lag < 1:
            raise ValueError(f"lag must be >= 1: a budget from the current step's survival is not lossless, got {lag}")
        if min_predicted_gain is not None and not min_predicted_gain >= 0:
            raise ValueError(f"min_predicted_gain must be >= 0 or None, got {min_predicted_gain}")
        self.block_size = int(block_size)
        self.cost_table = cost_table
        self.lag = int(lag)
        self.min_predicted_gain = min_predicted_gain
        # (step, slots, generations, survival [rows, gamma]) of the steps observed in the last lag
        self._ring: deque[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = deque()
        # per slot: the generation and survival of its latest observation at least lag steps old
        self._known_gen = np.full(0, -1, np.int64)
        self._known = np.ones((0, self.block_size))
        self._last_observed: int | None = None
        self._price_cache: dict[int, tuple[np.ndarray, float, float, float]] = {}

    @property
    def can_trim(self) -> bool:
        """Whether any decision can be a trim.  Not without a table, and not with a table flat in
        K under a min-gain guard g > 0: tau(n) grows with n while T(R, n) stays put, so no
        budget's throughput beats verify-all's by 1 + g.  The worker then keeps no lag ring."""
        g = self.min_predicted_gain
        return self.cost_table is not None and (self.cost_table.prices_budget or g is None or g <= 0)

    @property
    def can_decode(self) -> bool:
        """Whether a decision can be a plain decode step (the table prices one)."""
        return self.cost_table is not None and self.cost_table.prices_decode

    def verify_all(self, num_rows: int) -> BudgetDecision:
        """What ``decide_budget`` returns when ``can_trim`` is False, without survival: verify-all
        with its predicted step time (expected tokens unknown: NaN)."""
        full = num_rows * self.block_size
        if self.cost_table is None:
            return BudgetDecision(full, full, float("nan"), None, None)
        return BudgetDecision(full, full, float("nan"), self.price(num_rows, full), float("nan"))

    def price(self, num_rows: int, budget: int) -> float:
        """Predicted seconds of a step of num_rows requests verifying ``budget`` drafts (a budget
        settled on after the decision, e.g. filled up to its tier, is priced as it will run)."""
        return float(self._prices(num_rows)[0][budget])

    # -- role 1: the batch budget -------------------------------------------------------
    def decide_budget(self, lagged_survival, fresh_mask) -> BudgetDecision:
        """K = global argmax of tau(n) / T(R, n) over n = 0..#candidates (module doc).

        The min-gain guard compares the argmax with verify-all (K = R * gamma, tau over every
        candidate) and keeps verify-all unless the argmax's predicted throughput is at least
        ``1 + g`` times higher: noise in calibration or timing should not buy an unproven trim."""
        s = _survival_matrix(lagged_survival, self.block_size, "lagged_survival")
        fresh = np.asarray(fresh_mask, dtype=bool)
        if fresh.shape != (s.shape[0],):
            raise ValueError(f"fresh_mask must have shape [{s.shape[0]}], got {fresh.shape}")
        if fresh.any():
            s = np.where(fresh[:, None], 1.0, s)
        return self._decide(s)

    def decide_lagged(self, step: int, slot_generation, slots=None) -> BudgetDecision:
        """``decide_budget(*lagged(step, ...))`` without re-checking survival the ring already
        checked when it was observed (the worker's per-round path)."""
        return self._decide(self._lagged_values(step, slot_generation, slots)[0])

    def _decide(self, survival: np.ndarray) -> BudgetDecision:
        """The argmax on checked survival [R, gamma] with fresh rows already set to 1, or a plain
        decode step where the table prices one and the best budget does not beat it by 1 + g."""
        best = self._decide_budget(survival)
        if not self.can_decode or best.predicted_tokens_per_second is None:
            return best
        num_rows = survival.shape[0]
        seconds = max(self.cost_table.predict_decode(num_rows), 1e-9)
        if best.predicted_tokens_per_second < num_rows / seconds * (1.0 + (self.min_predicted_gain or 0.0)):
            return BudgetDecision(0, best.num_candidates, float(num_rows), seconds, num_rows / seconds, decode=True)
        return best

    def _decide_budget(self, survival: np.ndarray) -> BudgetDecision:
        """The speculative argmax (module doc) on checked survival with fresh rows set to 1."""
        num_rows = survival.shape[0]
        full = num_rows * self.block_size
        vals = survival.ravel()
        cands = vals[vals >= SURVIVAL_EPS]
        if self.cost_table is None:  # verify all: no ranking needed
            return BudgetDecision(full, cands.size, float(num_rows + cands.sum(dtype=np.float64)), None, None)
        prices, lo, hi, full_price = self._prices(num_rows)
        g = self.min_predicted_gain
        if g is not None and hi < lo * (1.0 + g):
            # No trim can pass the guard: a trim's predicted throughput is at most
            # tau(all) / T_min <= the verify-all throughput x T_max / T_min < (1 + g) x it.
            tau_all = float(num_rows + cands.sum(dtype=np.float64))
            return BudgetDecision(full, cands.size, tau_all, full_price, tau_all / full_price, True)
        cands = cands.astype(np.float64)  # a copy, also of a float64 view of the lag ring
        cands.sort()
        tau = np.empty(cands.size + 1)
        tau[0] = num_rows
        np.add.accumulate(cands[::-1], out=tau[1:])
        tau[1:] += num_rows  # tau[n], n = 0..#cands
        step_seconds = prices[: cands.size + 1]  # n = 0..#candidates
        throughput = tau / step_seconds
        k = int(np.argmax(throughput))  # first maximum: ties go to the smaller budget
        if g is not None and k != full:
            full_throughput = float(tau[-1]) / full_price  # tau over all candidates ~ tau(full)
            if throughput[k] < full_throughput * (1.0 + g):
                return BudgetDecision(full, cands.size, float(tau[-1]), full_price, full_throughput, True)
        return BudgetDecision(k, cands.size, float(tau[k]), float(step_seconds[k]), float(throughput[k]))

    def _prices(self, num_rows: int) -> tuple[np.ndarray, float, float, float]:
        """The table's T(num_rows, n) for every budget n = 0..num_rows * gamma (floored at 1 ns),
        its min and max, and T(num_rows, verify-all), cached by batch size."""
        hit = self._price_cache.get(num_rows)
        if hit is None:
            prices = np.maximum(np.asarray(self.cost_table.predict(num_rows, np.arange(num_rows * self.block_size + 1)),
                                           np.float64), 1e-9)
            hit = self._price_cache[num_rows] = (prices, float(prices.min()), float(prices.max()), float(prices[-1]))
        return hit

    def budget(self, lagged_survival, fresh_mask) -> int:
        """K for a step: see ``decide_budget`` for the full record."""
        return self.decide_budget(lagged_survival, fresh_mask).budget

    # -- role 2: per-request verify lengths ---------------------------------------------
    def verify_lens(self, current_survival, budget: int) -> np.ndarray:
        """Verify length per request (anchor included, 1..gamma+1) from the global top-``budget``.

        Ranking: survival descending, then position ascending, then request ascending.  Exactly
        ``min(budget, R * gamma)`` draft positions are chosen, each request's a prefix."""
        s = _survival_matrix(current_survival, self.block_size, "current_survival")
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if s.shape[1] > 1:
            bad = np.flatnonzero(np.any(s[:, 1:] > s[:, :-1], axis=1))
            if bad.size:
                raise ValueError(
                    f"survival must be non-increasing along positions (a cumulative product of confidences); "
                    f"rows {bad[:8].tolist()} are not, e.g. row {bad[0]}: {s[bad[0]].tolist()}"
                )
        num_rows = s.shape[0]
        k = min(int(budget), s.size)
        if k == 0:
            return np.ones(num_rows, np.int32)
        if k == s.size:
            return np.full(num_rows, self.window, np.int32)
        # Position-major flattening (index = j * R + r) puts candidates in tie-break order.
        flat = s.T.ravel()
        kth = np.partition(flat, flat.size - k)[flat.size - k]  # the k-th largest value
        take = flat > kth
        need = k - int(np.count_nonzero(take))
        take[np.flatnonzero(flat == kth)[:need]] = True  # ties at the threshold: lowest (j, r) first
        chosen = take.reshape(self.block_size, num_rows)
        # Prefix property (see module doc): a row's chosen positions never have a gap.
        if np.any(chosen[1:] & ~chosen[:-1]):
            raise AssertionError("top-K selection is not a prefix per request; survival ordering is broken")
        return (1 + np.count_nonzero(chosen, axis=0)).astype(np.int32)

    @property
    def window(self) -> int:
        return self.block_size + 1

    # -- the lag ring --------------------------------------------------------------------
    def observe(self, step: int, survival, slot_generation, slots=None) -> None:
        """Record step ``step``'s survival [R, gamma] for the requests in ``slots`` (default
        0..R-1), with each slot's generation id.  Steps must increase.  The rows are kept as
        observed (copied, ~1 us) and matched to slots when read."""
        s = _survival_matrix(survival, self.block_size, "survival")
        slots_arr, gens = self._rows(s.shape[0], slot_generation, slots)
        if self._last_observed is not None and step <= self._last_observed:
            raise ValueError(f"observed steps must increase: got {step} after {self._last_observed}")
        self._last_observed = int(step)
        self._ring.append((int(step), slots_arr.copy(), gens.copy(), s.copy()))

    def lagged(self, step: int, slot_generation, slots=None) -> LaggedSurvival:
        """Each slot's latest survival observed at ``step - lag`` or before; fresh (1.0) where unknown."""
        survival, fresh = self._lagged_values(step, slot_generation, slots)
        return LaggedSurvival(np.array(survival, dtype=np.float64), fresh)  # a copy: never the scheduler's own

    def _settle(self, step: int) -> None:
        """Fold the observations at least lag steps before ``step`` into the per-slot memory."""
        while self._ring and self._ring[0][0] <= step - self.lag:
            _, slots, gens, surv = self._ring.popleft()
            if slots.size and slots.max() >= self._known_gen.size:
                n = int(slots.max()) + 1
                self._known_gen = np.concatenate([self._known_gen, np.full(n - self._known_gen.size, -1, np.int64)])
                self._known = np.concatenate([self._known, np.ones((n - self._known.shape[0], self.block_size))])
            self._known_gen[slots] = gens
            self._known[slots] = surv

    def _lagged_values(self, step: int, slot_generation, slots) -> tuple[np.ndarray, np.ndarray]:
        self._settle(step)
        slots_arr, gens = self._rows(None, slot_generation, slots)
        inside = slots_arr < self._known_gen.size
        idx = np.where(inside, slots_arr, 0)
        same = inside & (gens >= 0) & (self._known_gen[idx] == gens) if self._known_gen.size else inside
        if same.all():
            return self._known[idx], ~same
        if not same.any():
            return np.ones((slots_arr.size, self.block_size)), ~same
        return np.where(same[:, None], self._known[idx], 1.0), ~same

    def reset(self) -> None:
        """Forget every observation (all rows read fresh until ``lag`` more steps are seen)."""
        self._ring.clear()
        self._known_gen = np.full(0, -1, np.int64)
        self._known = np.ones((0, self.block_size))
        self._last_observed: int | None = None

    @staticmethod
    def _rows(num_rows: int | None, slot_generation, slots) -> tuple[np.ndarray, np.ndarray]:
        gens = np.asarray(slot_generation, dtype=np.int64).reshape(-1)
        if num_rows is not None and gens.size != num_rows:
            raise ValueError(f"slot_generation has {gens.size} entries for {num_rows} rows")
        slots_arr = np.arange(gens.size) if slots is None else np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots_arr.size != gens.size:
            raise ValueError(f"slots has {slots_arr.size} entries but slot_generation has {gens.size}")
        if slots_arr.size and slots_arr.min() < 0:
            raise ValueError("slot indices must be >= 0")
        if slots_arr.size and np.bincount(slots_arr).max() > 1:  # (np.unique sorts: 3x the cost per round)
            raise ValueError("slot indices must be distinct")
        return slots_arr, gens

    # -- one synchronous step --------------------------------------------------------------
    def plan_step(self, step: int, current_survival, slot_generation, slots=None) -> StepRecord:
        """Budget from the lag ring, allocation on ``current_survival``, then record it.

        For engines that decide on the host right after drafting; an overlapped engine calls
        ``lagged`` + ``decide_budget`` before the draft lands and ``verify_lens`` after."""
        decision = self.decide_lagged(step, slot_generation, slots)  # before step t's survival is read
        lens = self.verify_lens(current_survival, decision.budget)
        self.observe(step, current_survival, slot_generation, slots)
        return StepRecord(step, lens.size, decision.budget, lens, decision.expected_tokens,
                          decision.predicted_step_seconds, decision.guard_applied)
