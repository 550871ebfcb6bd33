"""The device sampler against numpy: filtering masks and the sampled distribution."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.sampling import _filtered_logits, sample


def np_filter(logits, temp, top_k, top_p):
    """Keep the top-k tokens and the smallest prefix (by prob) whose mass reaches top_p."""
    out = np.full_like(logits, -np.inf)
    for r in range(logits.shape[0]):
        l = logits[r] / max(temp[r], 1e-6)
        order = np.argsort(-l, kind="stable")
        keep = set(order[: top_k[r]] if top_k[r] > 0 else order)
        p = np.exp(l[order] - l.max())
        p /= p.sum()
        nucleus, mass = set(), 0.0
        for i, t in enumerate(order):
            if top_p[r] < 1.0 and mass >= top_p[r]:  # top_p 1 keeps every token
                break
            nucleus.add(t)
            mass += p[i]
        for t in keep & nucleus:
            out[r, t] = l[t]
    return out


def test_filter_matches_numpy():
    rng = np.random.default_rng(0)
    R, V = 6, 50
    logits = rng.standard_normal((R, V)).astype(np.float32) * 3
    temp = np.array([1.0, 0.5, 2.0, 1.0, 0.7, 1.3], np.float32)
    top_k = np.array([0, 5, 0, 10, 1, 20], np.int32)
    top_p = np.array([1.0, 1.0, 0.8, 0.5, 0.9, 0.3], np.float32)
    ours = np.asarray(_filtered_logits(jnp.asarray(logits), temp, top_k, top_p))
    ref = np_filter(logits, temp, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
    np.testing.assert_allclose(ours[np.isfinite(ours)], ref[np.isfinite(ref)], rtol=1e-5)


@pytest.mark.parametrize("temp, top_k, top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.5, 0, 0.7)])
def test_sampled_frequencies_follow_filtered_softmax(temp, top_k, top_p):
    rng = np.random.default_rng(1)
    V, N = 8, 20000
    row = rng.standard_normal(V).astype(np.float32)
    logits = jnp.broadcast_to(row, (N, V))
    full = lambda v, dt: jnp.full((N,), v, dt)
    toks = np.asarray(sample(logits, full(temp, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                             jnp.arange(N, dtype=jnp.uint32), full(3, jnp.int32)))
    f = np_filter(row[None], [temp], [top_k], [top_p])[0]
    p = np.exp(f - f[np.isfinite(f)].max())
    p /= p.sum()
    counts = np.bincount(toks, minlength=V)
    assert counts[p == 0].sum() == 0  # filtered tokens never drawn
    expected = p * N
    chi2 = (((counts - expected) ** 2 / np.where(expected > 0, expected, 1))[p > 0]).sum()
    # 99.9th percentile of chi-square with <= 7 degrees of freedom is 24.3
    assert chi2 < 24.3, (chi2, counts, expected)


def test_greedy_rows_take_argmax_even_in_mixed_batch():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((4, 30)), jnp.float32)
    toks = np.asarray(sample(logits, jnp.array([0.0, 1.0, 0.0, 1.0]), jnp.zeros(4, jnp.int32), jnp.ones(4),
                             jnp.arange(4, dtype=jnp.uint32), jnp.zeros(4, jnp.int32)))
    am = np.asarray(logits).argmax(-1)
    assert toks[0] == am[0] and toks[2] == am[2]


def test_host_chosen_variants_match_the_device_choice():
    """"stochastic" (no conditional) draws exactly the tokens of "any" in a mixed batch, "greedy"
    is the argmax; only "any" compiles a conditional and "greedy" compiles no sort."""
    import jax

    rng = np.random.default_rng(3)
    R, V = 6, 50
    logits = jnp.asarray(rng.normal(size=(R, V)) * 3, jnp.float32)
    temp = jnp.asarray([0.0, 0.7, 1.0, 0.0, 1.3, 0.5], jnp.float32)
    top_k = jnp.asarray([0, 5, 0, 3, 0, 10], jnp.int32)
    top_p = jnp.asarray([1.0, 1.0, 0.8, 1.0, 0.5, 0.9], jnp.float32)
    seed = jnp.arange(R, dtype=jnp.uint32) + 11
    pos = jnp.arange(R, dtype=jnp.int32) * 7
    args = (logits, temp, top_k, top_p, seed, pos)
    np.testing.assert_array_equal(sample(*args, variant="stochastic"), sample(*args, variant="any"))
    greedy_args = (logits, jnp.zeros(R), top_k, top_p, seed, pos)
    np.testing.assert_array_equal(sample(*greedy_args, variant="greedy"), np.argmax(np.asarray(logits), -1))
    np.testing.assert_array_equal(sample(*greedy_args, variant="stochastic"), sample(*greedy_args, variant="greedy"))
    hlo = {v: jax.jit(lambda *a, v=v: sample(*a, variant=v)).lower(*args).as_text() for v in ("any", "greedy", "stochastic")}
    conditionals = {v: text.count("stablehlo.case") + text.count("stablehlo.if") for v, text in hlo.items()}
    # "any" chooses sampling on the device; both sampling variants choose the filter's sort there
    assert conditionals == {"any": 2, "greedy": 0, "stochastic": 1}, conditionals
    assert "sort" not in hlo["greedy"] and "sort" in hlo["stochastic"]
    with pytest.raises(ValueError, match="variant"):
        sample(*args, variant="topk")


def test_rows_without_filters_skip_the_cut_and_ignore_their_batch():
    """No row filters: the tempered logits come back untouched.  A row without filters gets the
    same logits whether or not another row of its batch filters (the cut is then computed for the
    whole batch), and top_p 1 keeps even a tail whose float32 cumulative mass rounds to 1, which
    the cut alone would drop."""
    rng = np.random.default_rng(4)
    R, V = 4, 40
    logits = rng.standard_normal((R, V)).astype(np.float32) * 3
    logits[0, 1:] = -40.0  # the tail's mass (~4e-18 each) vanishes next to the first token's
    temp = np.array([1.0, 0.7, 0.0, 1.3], np.float32)
    none_k, none_p = np.zeros(R, np.int32), np.ones(R, np.float32)
    plain = np.asarray(_filtered_logits(jnp.asarray(logits), temp, none_k, none_p))
    np.testing.assert_array_equal(plain, np.asarray(jnp.asarray(logits) / jnp.maximum(jnp.asarray(temp), 1e-6)[:, None]))
    mixed_k, mixed_p = none_k.copy(), none_p.copy()
    mixed_k[3], mixed_p[1] = 5, 0.6  # rows 1 and 3 filter, rows 0 and 2 do not
    mixed = np.asarray(_filtered_logits(jnp.asarray(logits), temp, mixed_k, mixed_p))
    np.testing.assert_array_equal(mixed[[0, 2]], plain[[0, 2]])
    assert np.isfinite(mixed[0]).all()
    ref = np_filter(logits, temp, mixed_k, mixed_p)
    np.testing.assert_array_equal(np.isfinite(mixed), np.isfinite(ref))
