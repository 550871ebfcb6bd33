"""Block-accept estimator: the uncensored ceiling of compact verification, estimated in-run.

Why it exists.  In compact mode a request drafts gamma tokens d_1..d_gamma after its anchor at
position s (drafts at s+1..s+gamma) but the target scores only a window of w of them.  The
"ceiling" of a round is what verifying the whole block would have delivered, block_accept + 1.
When the row rejects inside its window (accepted < w) the ceiling is observed exactly:
accepted + 1.  When every verified draft is accepted (accepted == w < gamma) the tail
d_{w+1..gamma} was never scored and the ceiling is *censored*: it is at least w + 1, and the
mean of those lower values understates what the drafter could deliver.  cap-accept mode measures
the ceiling by verifying everything; this estimator (SGLang's ``dspark_block_accept_estimator``)
brackets it inside a compact run at no extra target work.

How.  A censored row opens a *pending block* with the trimmed tokens, their absolute positions and
their draft log-probs log q_k.  The request then keeps decoding through those positions.  While
the realised tokens equal the trimmed tokens, the realised prefix *is* the draft prefix, so the
target's temperature-scaled log p_k of the trimmed token at its position (a later verify row, or
the creating round's last verified row for d_{w+1}) is exactly the number full verification would
have used.  Walking forward::

    a_k = min(1, p_k / q_k);  prod *= a_k;  lo_extra += prod

and continuing only while realised == trimmed.  Finalising with lo = w + 1 + lo_extra:

* walked through the whole tail: hi = lo (the interval is exact);
* divergence (realised != trimmed): hi = lo + prod * (tail tokens after the diverged one);
* the request ends at EOS: hi = lo (nothing after EOS counts);
* truncated (max tokens, abort, discontinuity, an ineligible round): hi = lo + prod * (unresolved).

Given the drafts, the expected ceiling of a censored row is w + 1 + sum_k prod_{i<=k} a_i over the
whole tail; the walk sums exactly its first terms and every later term lies in [0, prod] (a_i <= 1),
so lo <= E[ceiling | drafts] <= hi for every block (EOS aside).  The means of lo and hi therefore
bracket the mean ceiling; mid = (lo + hi) / 2 is a point estimate with no such guarantee.

Scope.  Temperature sampling rows only: for greedy or top-k / top-p rows p and q are not the plain
tempered softmaxes, so the engine passes them as ineligible and they are not counted.

Protocol per round (host side, numpy, engine-agnostic; ``request_ids`` are any hashable keys):

1. ``probe_tokens(ids, starts, num_rows)`` before the round: [B, num_rows, max_pending] tokens
   whose target log-probs the engine gathers, row j being the verify row at position starts + j
   (its distribution is for position starts + j + 1); -1 where nothing is asked.  A request can
   have several blocks walking at once (one per recent censored round), hence the last axis.
2. ``update(...)`` after it, with those log-probs, the log p of d_{w+1} at the last verified row
   (known only on device during the round, so the engine gathers it there), and the committed
   tokens.  ``update`` must see every round of every decoding request (ineligible ones included):
   a start that does not continue the previous round is taken as a new request under a reused id.
3. ``finish(id, reason)`` when the request ends.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Hashable, NamedTuple, Sequence

import numpy as np

FINISH_REASONS = ("eos", "length", "abort")


class BlockOutcome(NamedTuple):
    """One counted row: lo == hi unless the row was censored and not fully resolved."""
    request_id: Hashable
    start: int  # anchor position of the round
    window: int  # verified drafts w
    accepted: int  # drafts accepted in that round
    lo: float
    hi: float
    # untrimmed | full | complete | diverged | eos | length | abort | discontinuity | ineligible
    reason: str


@dataclasses.dataclass
class _Block:
    """A censored round: tail tokens d_{w+1..gamma} at positions start + w + 1 ..."""
    start: int
    window: int
    tokens: np.ndarray
    logq: np.ndarray
    walked: int = 0  # tail tokens scored so far
    prod: float = 1.0
    lo_extra: float = 0.0

    @property
    def next_pos(self) -> int:
        return self.start + self.window + 1 + self.walked

    @property
    def unresolved(self) -> int:
        return len(self.tokens) - self.walked

    def score(self, logp: float) -> None:
        lq = float(self.logq[self.walked])
        self.prod *= 1.0 if logp >= lq else math.exp(logp - lq)
        self.lo_extra += self.prod
        self.walked += 1

    def bounds(self, eos: bool) -> tuple[float, float]:
        lo = self.window + 1.0 + self.lo_extra
        return lo, lo if eos else lo + self.prod * self.unresolved


class _Stats:
    """Cumulative and last-`window`-rows sums of lo and hi."""

    def __init__(self, window: int):
        self.recent: collections.deque = collections.deque(maxlen=window)
        self.rows, self.lo_sum, self.hi_sum = 0, 0.0, 0.0

    def add(self, lo: float, hi: float) -> None:
        self.recent.append((lo, hi))
        self.rows += 1
        self.lo_sum += lo
        self.hi_sum += hi

    def summary(self) -> dict:
        recent = np.asarray(self.recent, float).reshape(-1, 2)
        return {**_means(self.rows, self.lo_sum, self.hi_sum),
                "window": _means(len(recent), float(recent[:, 0].sum()), float(recent[:, 1].sum()))}


def _means(rows: int, lo_sum: float, hi_sum: float) -> dict:
    if rows == 0:
        return {"rows": 0, "lo_mean": None, "hi_mean": None, "mid_mean": None}
    lo, hi = lo_sum / rows, hi_sum / rows
    return {"rows": rows, "lo_mean": lo, "hi_mean": hi, "mid_mean": 0.5 * (lo + hi)}


@dataclasses.dataclass
class _Request:
    next_start: int  # anchor position of the request's next round (its last realised token)
    stats: _Stats
    blocks: list = dataclasses.field(default_factory=list)


class BlockAcceptEstimator:
    """Per-request pending blocks plus aggregate [lo, hi] ceiling statistics (see module doc)."""

    def __init__(self, gamma: int, window: int = 256, *, keep_outcomes: bool = False):
        if gamma < 1 or window < 1:
            raise ValueError(f"gamma and window must be >= 1, got {gamma}, {window}")
        self.gamma = gamma
        self.window = window
        # Walkable blocks at probe time come from distinct earlier rounds less than gamma positions
        # back (<= gamma - 1), plus at most one never-walked block of a request that is stopping.
        self.max_pending = gamma
        self.keep_outcomes = keep_outcomes
        self._requests: dict[Hashable, _Request] = {}
        self._stats = _Stats(window)
        self._outcomes: list[BlockOutcome] = []

    # -- per-round protocol -------------------------------------------------------------------

    def probe_tokens(self, request_ids: Sequence[Hashable], starts, num_rows: int) -> np.ndarray:
        """[B, num_rows, max_pending] int32: token whose target log p the engine gathers from row j
        (position starts[i] + j, distribution for starts[i] + j + 1) for pending block slot p;
        -1 where no probe.  Pure: no state changes."""
        starts = np.asarray(starts, np.int64).reshape(len(request_ids))
        out = np.full((len(request_ids), num_rows, self.max_pending), -1, np.int32)
        for i, rid in enumerate(request_ids):
            req = self._requests.get(rid)
            if req is None or req.next_start != starts[i]:
                continue
            for p, blk in enumerate(req.blocks):
                if blk.next_pos == starts[i] + 1:
                    tail = blk.tokens[blk.walked:blk.walked + num_rows]
                    out[i, :len(tail), p] = tail
        return out

    def update(self, request_ids: Sequence[Hashable], starts, windows, accepted, drafts, draft_logq,
               probe_logp, next_draft_logp, committed_tokens: Sequence, eligible, gamma_full=False) -> None:
        """Fold one verify round into the estimate.

        starts [B] anchor positions; windows [B] verified drafts w (verify_len - 1); accepted [B]
        drafts accepted (with gamma_full, the full-block count); drafts / draft_logq [B, gamma]
        (log q of each draft under the tempered corrected draft distribution); probe_logp
        [B, R, max_pending] target log p of this round's probe_tokens (ignored where the probe
        was -1; R >= the rows a walk needs); next_draft_logp [B] target log p of d_{w+1} at row w
        (NaN where w == gamma); committed_tokens: per request, the tokens realised at
        starts + 1, ... (accepted drafts + bonus, after any stop truncation); eligible [B] or
        scalar (temperature sampling without top-k / top-p); gamma_full [B] or scalar: the round
        verified the whole block, so nothing is censored and accepted + 1 is exact."""
        B = len(request_ids)
        if B == 0:
            return
        starts, windows, accepted = (np.asarray(x, np.int64).reshape(B) for x in (starts, windows, accepted))
        drafts = np.asarray(drafts).reshape(B, self.gamma)
        draft_logq = np.asarray(draft_logq, np.float64).reshape(B, self.gamma)
        probe_logp = np.asarray(probe_logp, np.float64).reshape(B, -1, self.max_pending)
        next_draft_logp = np.asarray(next_draft_logp, np.float64).reshape(B)
        eligible = np.broadcast_to(np.asarray(eligible, bool), (B,))
        full = np.broadcast_to(np.asarray(gamma_full, bool), (B,))
        if len(committed_tokens) != B:
            raise ValueError(f"committed_tokens has {len(committed_tokens)} entries for {B} rows")
        if np.any((accepted < 0) | (accepted > windows) | (windows > self.gamma)):
            raise ValueError("need 0 <= accepted <= windows <= gamma")
        trimmed = eligible & ~full & (accepted == windows) & (windows < self.gamma)
        for i, rid in enumerate(request_ids):
            start, realised = int(starts[i]), np.asarray(committed_tokens[i]).reshape(-1)
            req = self._continue(rid, start)
            if not eligible[i]:
                self._close_all(rid, req, "ineligible")
            else:
                self._walk_pending(rid, req, start, realised, probe_logp[i])
                if trimmed[i]:
                    self._open(rid, req, start, int(windows[i]), drafts[i], draft_logq[i], realised,
                               next_draft_logp[i])
                else:
                    a = int(accepted[i])
                    reason = "full" if full[i] or windows[i] == self.gamma else "untrimmed"
                    self._record(req, BlockOutcome(rid, start, int(windows[i]), a, a + 1.0, a + 1.0, reason))
            req.next_start = start + len(realised)

    def finish(self, request_id: Hashable, reason: str) -> dict:
        """The request ended ("eos": natural stop, "length": token limit, "abort"): finalise its
        pending blocks, forget it, and return its summary (as request_summary)."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        req = self._requests.pop(request_id, None)
        if req is None:
            return self.request_summary(request_id)
        self._close_all(request_id, req, reason)
        return {**req.stats.summary(), "pending": 0}

    # -- read-out -----------------------------------------------------------------------------

    def summary(self) -> dict:
        """{"rows", "lo_mean", "hi_mean", "mid_mean", "window": {same over the last `window`
        counted rows}, "pending": blocks not yet finalised (not in the means)}."""
        pending = sum(len(r.blocks) for r in self._requests.values())
        return {**self._stats.summary(), "pending": pending}

    def request_summary(self, request_id: Hashable) -> dict:
        """summary() over one live request's rows (empty for unknown or finished ids)."""
        req = self._requests.get(request_id)
        if req is None:
            return {**_Stats(self.window).summary(), "pending": 0}
        return {**req.stats.summary(), "pending": len(req.blocks)}

    def drain_outcomes(self) -> list[BlockOutcome]:
        """Counted rows since the last drain, in finalisation order (keep_outcomes=True only)."""
        out, self._outcomes = self._outcomes, []
        return out

    # -- internals ----------------------------------------------------------------------------

    def _continue(self, rid: Hashable, start: int) -> _Request:
        """The request's state; a start that does not continue it means a new request (reused id)."""
        req = self._requests.get(rid)
        if req is not None and req.next_start != start:
            self._close_all(rid, req, "discontinuity")
            req = None
        if req is None:
            req = self._requests[rid] = _Request(next_start=start, stats=_Stats(self.window))
        return req

    def _walk_pending(self, rid, req: _Request, start: int, realised: np.ndarray, probe_logp: np.ndarray) -> None:
        kept = []
        for p, blk in enumerate(req.blocks):
            if blk.next_pos != start + 1:  # never walked (stop inside the window) or out of step
                self._close(rid, req, blk, "discontinuity")
                continue
            ended = _walk(blk, start, realised, probe_logp[:, p])
            if ended is None:
                kept.append(blk)
            else:
                self._close(rid, req, blk, ended)
        req.blocks = kept

    def _open(self, rid, req: _Request, start: int, w: int, drafts, logq, realised, next_logp: float) -> None:
        blk = _Block(start, w, np.array(drafts[w:]), np.array(logq[w:]))
        row_logp = np.full(max(len(realised), w + 1), np.nan)
        row_logp[w] = next_logp
        ended = _walk(blk, start, realised, row_logp)
        if ended is None:
            req.blocks.append(blk)
        else:
            self._close(rid, req, blk, ended)

    def _close_all(self, rid, req: _Request, reason: str) -> None:
        for blk in req.blocks:
            self._close(rid, req, blk, reason)
        req.blocks = []

    def _close(self, rid, req: _Request, blk: _Block, reason: str) -> None:
        lo, hi = blk.bounds(eos=reason == "eos")
        self._record(req, BlockOutcome(rid, blk.start, blk.window, blk.window, lo, hi, reason))

    def _record(self, req: _Request, out: BlockOutcome) -> None:
        self._stats.add(out.lo, out.hi)
        req.stats.add(out.lo, out.hi)
        if self.keep_outcomes:
            self._outcomes.append(out)


def _walk(blk: _Block, start: int, realised: np.ndarray, row_logp: np.ndarray) -> str | None:
    """Advance `blk` over this round's realised positions start + 1 .. start + len(realised).

    row_logp[j]: target log p of the block's token at position start + j + 1 (row j).  Returns
    "diverged" or "complete" when the block ends, None while it stays pending."""
    for j in range(blk.next_pos - start - 1, len(realised)):
        if blk.unresolved == 0:
            break
        if j >= len(row_logp) or np.isnan(row_logp[j]):
            raise ValueError(f"missing target log p for the pending token at row {j} (position {start + j + 1})")
        blk.score(float(row_logp[j]))
        if realised[j] != blk.tokens[blk.walked - 1]:
            return "diverged"
    return "complete" if blk.unresolved == 0 else None
