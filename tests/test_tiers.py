"""Token tiers: the default set, rounding, tier choice from (batch size, budget) only, slots."""

from __future__ import annotations

import itertools

import pytest

from dspark_jax.spec.common.tiers import TokenTiers

LADDER = [1, 2, 4, 8, 16, 32, 64]


def test_default_tiers_are_ladder_times_window():
    tiers = TokenTiers(block_size=7, batch_sizes=LADDER)
    assert tiers.window == 8
    assert tiers.tiers == (8, 16, 32, 64, 128, 256, 512)
    assert tiers.max_tier == 512 and tiers.max_batch_size == 64


def test_extra_and_stepped_tiers_merge_sorted_and_deduplicated():
    tiers = TokenTiers(7, [4, 1, 2], extra_tiers=[5, 16, 30])
    assert tiers.tiers == (5, 8, 16, 30, 32)
    stepped = TokenTiers(3, [1, 2, 4], tier_step=6)
    assert stepped.tiers == (4, 6, 8, 12, 16)
    with pytest.raises(ValueError, match=r"\[1, 32\]"):
        TokenTiers(7, [1, 2, 4], extra_tiers=[33])
    with pytest.raises(ValueError, match="ladder"):
        TokenTiers(7, [])


def test_round_up_includes_exact_boundaries():
    tiers = TokenTiers(7, LADDER, extra_tiers=[24])
    assert tiers.round_up(0) == 8
    assert tiers.round_up(1) == 8
    assert tiers.round_up(8) == 8  # exact boundary stays
    assert tiers.round_up(9) == 16
    assert tiers.round_up(17) == 24
    assert tiers.round_up(24) == 24
    assert tiers.round_up(25) == 32
    assert tiers.round_up(512) == 512
    with pytest.raises(ValueError, match="exceed the largest tier 512"):
        tiers.round_up(513)


def test_tier_for_uses_the_host_floor():
    tiers = TokenTiers(7, LADDER)
    # floor = min(bs * min_len + K, bs * 8)
    assert tiers.floor_tokens(32, 0) == 32
    assert tiers.tier_for(32, 0) == 32
    assert tiers.tier_for(32, 33) == 128  # 65 tokens -> tier 128
    assert tiers.tier_for(32, 32 * 7) == 256  # verify-all
    assert tiers.tier_for(32, 10_000) == 256  # a budget past verify-all is capped by bs * W
    assert tiers.tier_for(5, 35) == 64  # bs off the ladder: 40 tokens -> the bs=8 tier
    assert tiers.tier_for(4, 0, min_verify_len=3) == 16
    with pytest.raises(ValueError, match="batch_size"):
        tiers.tier_for(65, 0)
    with pytest.raises(ValueError, match="budget"):
        tiers.tier_for(4, -1)
    with pytest.raises(ValueError, match="min_verify_len"):
        tiers.tier_for(4, 0, min_verify_len=9)


def test_tier_is_a_pure_function_of_bs_and_budget_and_holds_every_allocation():
    """Same (bs, K) -> same tier, whatever the per-request lengths turn out to be; and every
    allocation the top-K can produce (sum of lengths <= bs + K, each in 1..W) fits in it."""
    tiers = TokenTiers(7, LADDER, extra_tiers=[24, 48, 96])
    for bs, k in itertools.product(range(1, 65), range(0, 7 * 64 + 1, 13)):
        t = tiers.tier_for(bs, k)
        assert t == tiers.tier_for(bs, k)
        assert t >= min(bs + k, bs * 8)
        assert t in tiers.tiers
        assert tiers.slots(t) >= bs  # the batch always has a request slot in its tier


def test_slots_per_tier():
    tiers = TokenTiers(7, LADDER)
    assert [tiers.slots(t) for t in tiers.tiers] == [8, 16, 32, 64, 64, 64, 64]
    # T // W slots could not hold a trimmed batch: 32 requests, K = 0 -> tier 32 -> 4 slots.
    assert tiers.tier_for(32, 0) // tiers.window < 32 <= tiers.slots(tiers.tier_for(32, 0))
    assert tiers.shapes()[-1] == (512, 64)
    with pytest.raises(ValueError, match="not a tier"):
        tiers.slots(100)


def test_rows_per_tier_hold_every_batch_with_the_fewest_rows():
    """A tier compiles the covering slots and the rows of the verify-all batch that fills it; a
    batch gets the fewest that hold it, so a lone request on tier 8 runs one row, not eight."""
    tiers = TokenTiers(7, LADDER, tier_step=64)
    assert tiers.row_options(8) == (1, 8)
    assert tiers.row_options(16) == (2, 16)
    assert tiers.row_options(192) == (32, 64)  # 24 verify-all requests round up to the 32 bucket
    assert tiers.row_options(512) == (64,)
    assert tiers.rows_for(8, 1) == 1 and tiers.rows_for(8, 2) == 8
    for bs, k in itertools.product(range(1, 65), range(0, 7 * 64 + 1, 13)):
        t = tiers.tier_for(bs, k)
        rows = tiers.rows_for(t, bs)
        assert rows >= bs and rows in tiers.row_options(t)
        assert all(r < bs for r in tiers.row_options(t) if r < rows)
        if k >= bs * 7:  # a verify-all batch runs on its own bucket's rows
            assert rows == LADDER[next(i for i, b in enumerate(LADDER) if b >= bs)]
    assert sorted(set(tiers.shapes())) == sorted(tiers.shapes())
    for bs in range(1, 65):  # a verify-all round finds its rows among the untrimmed shapes
        t = tiers.round_up(bs * 8)
        assert (t, tiers.rows_for(t, bs)) in tiers.shapes(trimmed=False)
    with pytest.raises(ValueError, match="exceed"):
        tiers.rows_for(8, 9)
