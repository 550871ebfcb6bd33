"""Token tiers: the compiled verify shapes, and the choice of one from host scalars.

XLA compiles one executable per static shape, so the ragged verify step is compiled per *token
tier* (the length of the packed verify buffer), the analogue of SGLang's captured CUDA graphs.
By default the tiers are ``{bs * (gamma + 1) : bs in the batch-size ladder}``, i.e. every
verify-all batch of a ladder size fits exactly, plus any finer tiers asked for, so a trimmed
batch can drop to a genuinely smaller executable.

The tier of a step is a pure function of host scalars, the batch size and the budget K::

    floor = min(bs * min_verify_len + K, bs * (gamma + 1))      # tokens the step may verify
    tier  = smallest tier >= floor                               # bisect_left

It never looks at the per-request verify lengths: those are chosen on the current step's
confidence, possibly on device, and waiting for them would put a device-to-host read on the
critical path.  The top-K allocation verifies at most K tokens beyond the anchors, so the real
total never exceeds the floor; the rest of the tier is padding rows that point at the sentinel
slot and are never read.

Request slots per tier.  An executable also has a static number of request slots S (the length
of the per-request metadata: ``cu_q_lens``, ``kv_lens``, the page table).  SGLang's #34384 was a
geometry mismatch: each ragged CUDA graph was captured with a synthetic per-request layout baked
into its kernels (``min(T, max_bs)`` one-token rows), and a live batch with another request
geometry mapping to the same tier (32 requests x 6 tokens -> tier 192) replayed kernels set up
for a different layout and faulted.  Their fix captures each tier at its generating geometry,
``S = T // (gamma + 1)``, and sends batches with more requests than that to eager mode.

An XLA executable is specialised on shapes, not on the lengths inside ``cu_q_lens``, so no
request layout is baked in and that mismatch cannot happen here; the one geometry hazard left is
a batch with more requests than the executable has slots.  ``T // (gamma + 1)`` slots would make
that hazard the rule: a trimmed batch of bs requests lands on a tier below ``bs * (gamma + 1)``,
whose ``T // (gamma + 1)`` slots are fewer than bs (32 requests with K = 0 at gamma = 7 need 32
tokens, tier 32, 4 slots), and there is no eager fallback to send it to.  So every tier gets
``S = min(T, max_batch_size)`` slots: every request verifies at least its anchor, so any batch
that fits in T tokens has at most T requests, and never more than the ladder's largest batch.

Padding rows are not free: the drafter drafts a block for every row, and the attention of a
backend without a kernel (the CPU's plain jnp) computes them in full (a batch of one on tier 8
would draft eight blocks to use one).  So a tier also gets the rows of the batch that fills
it verifying everything, the ladder bucket of ``ceil(T / (gamma + 1))``, and a step takes the
fewest rows that hold its batch (``rows_for``): at most two executables per tier.  A round that
verifies every block (static) always lands on its own batch's tier, so it needs only the fewer.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class TokenTiers:
    """The sorted tier set for one block size and batch-size ladder."""

    def __init__(self, block_size: int, batch_sizes: Iterable[int], extra_tiers: Iterable[int] = (),
                 tier_step: int | None = None):
        """block_size: gamma, the drafts per block; a verify window is ``gamma + 1`` tokens.
        batch_sizes: the batch-size ladder (the decode buckets); each gives the tier bs * (gamma + 1).
        extra_tiers: finer tiers to add, each in [1, largest ladder tier].
        tier_step: if given, also add every multiple of it up to the largest ladder tier."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        ladder = sorted({int(b) for b in batch_sizes})
        if not ladder or ladder[0] < 1:
            raise ValueError(f"the batch-size ladder must be non-empty and >= 1, got {ladder}")
        self.block_size = int(block_size)
        self.window = self.block_size + 1
        self.batch_sizes = tuple(ladder)
        self.max_batch_size = ladder[-1]
        top = self.max_batch_size * self.window
        tiers = {b * self.window for b in ladder}
        extra = [int(t) for t in extra_tiers]
        if tier_step is not None:
            if tier_step < 1:
                raise ValueError(f"tier_step must be >= 1, got {tier_step}")
            extra += list(range(tier_step, top + 1, tier_step))
        bad = [t for t in extra if not 1 <= t <= top]
        if bad:
            raise ValueError(f"extra tiers must lie in [1, {top}] (the largest verify-all tier), got {bad}")
        self.tiers: tuple[int, ...] = tuple(sorted(tiers | set(extra)))

    @property
    def max_tier(self) -> int:
        return self.tiers[-1]

    def round_up(self, total_tokens: int) -> int:
        """The smallest tier holding ``total_tokens`` (a tier equal to it included)."""
        if total_tokens < 0:
            raise ValueError(f"total_tokens must be >= 0, got {total_tokens}")
        i = bisect.bisect_left(self.tiers, total_tokens)
        if i == len(self.tiers):
            raise ValueError(
                f"{total_tokens} verify tokens exceed the largest tier {self.max_tier} "
                f"(batch-size ladder up to {self.max_batch_size}, window {self.window})"
            )
        return self.tiers[i]

    def floor_tokens(self, batch_size: int, budget: int, min_verify_len: int = 1) -> int:
        """Most tokens a step of ``batch_size`` requests with budget K can verify."""
        if not 1 <= batch_size <= self.max_batch_size:
            raise ValueError(f"batch_size must be in [1, {self.max_batch_size}], got {batch_size}")
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if not 1 <= min_verify_len <= self.window:
            raise ValueError(f"min_verify_len must be in [1, {self.window}], got {min_verify_len}")
        return min(batch_size * min_verify_len + budget, batch_size * self.window)

    def tier_for(self, batch_size: int, budget: int, min_verify_len: int = 1) -> int:
        """The tier of a step: a function of (batch_size, budget, min_verify_len) only."""
        return self.round_up(self.floor_tokens(batch_size, budget, min_verify_len))

    def slots(self, tier: int) -> int:
        """Request slots compiled into ``tier``: ``min(tier, max_batch_size)`` (see module doc)."""
        if tier not in self.tiers:
            raise ValueError(f"{tier} is not a tier; tiers are {list(self.tiers)}")
        return min(tier, self.max_batch_size)

    def row_options(self, tier: int) -> tuple[int, ...]:
        """Request rows compiled for ``tier``: the slots of any batch it holds, and fewer for the
        batch that fills it verifying everything (see module doc)."""
        full = self.slots(tier)
        i = bisect.bisect_left(self.batch_sizes, -(-tier // self.window))
        return tuple(sorted({min(self.batch_sizes[i], full), full}))

    def rows_for(self, tier: int, batch_size: int) -> int:
        """The fewest compiled rows of ``tier`` that hold ``batch_size`` requests."""
        for rows in self.row_options(tier):
            if rows >= batch_size:
                return rows
        raise ValueError(f"{batch_size} requests exceed tier {tier}'s {self.slots(tier)} slots")

    def shapes(self, trimmed: bool = True) -> list[tuple[int, int]]:
        """(tokens, rows) of every executable the tiers need, for ahead-of-time compilation;
        trimmed=False: rounds that verify every block (the fewer rows of each tier)."""
        return [(t, rows) for t in self.tiers for rows in self.row_options(t)[:None if trimmed else 1]]

    def __repr__(self) -> str:
        return f"TokenTiers(window={self.window}, tiers={list(self.tiers)})"
