"""Host-side planning of one DSpark call: its rounds' budgets, the tier it runs and its price.

A pure function of host scalars (the batch size and each round's budget decision, taken from
lagged survival by the confidence scheduler), so the executable to dispatch is known without
reading anything back from the device.  The windows themselves are chosen on the device from
the current round's survival (spec/common/packing.topk_verify_lens).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence

from dspark_jax.spec.common.tiers import TokenTiers
from dspark_jax.spec.dspark.scheduler import BudgetDecision


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    mode: str  # the verify mode the call's executable runs
    budgets: tuple[int, ...]  # K of each round: drafts verified beyond the anchors
    tier: int  # tokens of the packed verify buffer
    rows: int  # request rows of the executable
    predicted_s: float | None  # predicted seconds per round (None without a cost table)


def plan_call(batch_size: int, decisions: Sequence[BudgetDecision], *, gamma: int, mode: str, tiers: TokenTiers,
              fill_tier: bool, price: Callable[[int, int], float] | None) -> RoundPlan:
    """The plan of a call of len(decisions) rounds for batch_size requests.

    mode "compact" runs the smallest tier holding the largest budget; the other modes verify
    every block (tier bs * (gamma + 1)); either runs on the fewest compiled rows that hold the
    batch.  fill_tier (scheduled rounds): every round verifies up to the tier's capacity, since
    its padding rows cost what verified ones would; the budget stays a function of host
    scalars, and the filled budget is what gets priced.  A call whose
    first decision is a plain decode step runs plain decode steps (mode "decode", one token per
    request, at the batch-size bucket)."""
    if decisions[0].decode:
        tier = tiers.batch_sizes[bisect.bisect_left(tiers.batch_sizes, batch_size)]
        return RoundPlan("decode", (0,) * len(decisions), tier, tier, decisions[0].predicted_step_seconds)
    full = batch_size * gamma
    budgets = [min(d.budget, full) for d in decisions]
    predictions = [d.predicted_step_seconds for d in decisions if d.predicted_step_seconds is not None]
    predicted = sum(predictions) / len(predictions) if predictions else None
    if fill_tier:
        fill = min(tiers.tier_for(batch_size, max(budgets)) - batch_size, full)
        budgets = [fill] * len(decisions)
        predicted = price(batch_size, fill) if price is not None else predicted
    tier = tiers.tier_for(batch_size, max(budgets)) if mode == "compact" else tiers.round_up(batch_size * (gamma + 1))
    return RoundPlan(mode, tuple(budgets), tier, tiers.rows_for(tier, batch_size), predicted)
