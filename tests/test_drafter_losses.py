"""DSpark loss terms on cases small enough to work out by hand."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.spec.dspark.losses import dspark_loss, position_weights, soft_acceptance


def test_position_weights_prefix_and_decay():
    w = np.asarray(position_weights(jnp.array([[True, True, False, True], [True, True, True, True]])))
    e = math.exp
    np.testing.assert_allclose(w[0], [1, e(-0.25), 0, 0], rtol=1e-6)  # the gap cuts the rest
    np.testing.assert_allclose(w[1], [1, e(-0.25), e(-0.5), e(-0.75)], rtol=1e-6)


def test_soft_acceptance_by_hand():
    # draft uniform over 3 tokens; target (1/2, 1/4, 1/4): L1 = 1/6 + 1/12 + 1/12 = 1/3, c* = 5/6.
    l1, c = soft_acceptance(jnp.zeros(3), jnp.log(jnp.array([2.0, 1.0, 1.0])))
    assert abs(float(l1) - 1 / 3) < 1e-6 and abs(float(c) - 5 / 6) < 1e-6
    l1, c = soft_acceptance(jnp.array([0.0, 50.0]), jnp.array([50.0, 0.0]))  # disjoint: L1 = 2, c* = 0
    assert abs(float(l1) - 2) < 1e-6 and float(c) == 0.0


def test_loss_terms_by_hand():
    # One block of gamma=2, vocab 3.  Position 0: draft uniform, target (1/2,1/4,1/4), label 0,
    # z = 0.  Position 1: draft = target = (1/2,1/4,1/4), label 1, z = ln 3.
    d = jnp.array([[[0.0, 0.0, 0.0], [math.log(2), 0.0, 0.0]]])
    t = jnp.array([[[math.log(2), 0.0, 0.0], [math.log(2), 0.0, 0.0]]])
    z = jnp.array([[0.0, math.log(3)]])
    out = dspark_loss(d, t, jnp.array([[0, 1]]), z, jnp.array([[True, True]]))
    w0, w1 = 1.0, math.exp(-0.25)
    ce = (w0 * math.log(3) + w1 * -math.log(0.25)) / (w0 + w1)
    l1 = (w0 * (1 / 3) + w1 * 0.0) / (w0 + w1)
    # BCE(z=0, c=5/6) = ln 2.  BCE(z=ln3, c=1) = -ln(sigmoid(ln 3)) = -ln(3/4).
    bce = (w0 * math.log(2) + w1 * -math.log(0.75)) / (w0 + w1)
    assert abs(float(out.ce) - ce) < 1e-5
    assert abs(float(out.l1) - l1) < 1e-5
    assert abs(float(out.bce) - bce) < 1e-5
    assert abs(float(out.loss) - (0.1 * ce + 0.9 * l1 + 1.0 * bce)) < 1e-5
    # tau = 1 + c*_0 + c*_0 c*_1 = 1 + 5/6 + 5/6
    assert abs(float(out.tau_probabilistic) - (1 + 5 / 6 + 5 / 6)) < 1e-5


def test_masked_positions_carry_no_loss_and_label_is_detached():
    rng = np.random.default_rng(0)
    d = jnp.asarray(rng.standard_normal((2, 3, 5)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((2, 3, 5)), jnp.float32)
    z = jnp.asarray(rng.standard_normal((2, 3)), jnp.float32)
    mask = jnp.array([[True, False, True], [True, True, True]])
    base = dspark_loss(d, t, jnp.zeros((2, 3), jnp.int32), z, mask).loss
    # Position (0, 2) is cut by the prefix rule: changing it changes nothing.
    moved = dspark_loss(d.at[0, 2].add(3.0), t.at[0, 2].add(-2.0), jnp.zeros((2, 3), jnp.int32), z.at[0, 2].add(5.0), mask).loss
    assert abs(float(base) - float(moved)) < 1e-6
    # The confidence gradient does not flow into the draft logits through the label.
    g = jax.grad(lambda dd: dspark_loss(dd, t, jnp.zeros((2, 3), jnp.int32), z, mask, weights=(0.0, 0.0, 1.0)).loss)(d)
    assert float(jnp.abs(g).max()) == 0.0


def test_greedy_confidence_label_by_hand():
    # Position 0: draft argmax 1, target argmax 0 -> greedy label 0 (soft label c* > 0).
    # Position 1: draft = target -> greedy label 1 (c* = 1 too).
    d = jnp.array([[[0.0, 1.0, 0.0], [math.log(2), 0.0, 0.0]]])
    t = jnp.array([[[math.log(2), 0.0, 0.0], [math.log(2), 0.0, 0.0]]])
    z = jnp.array([[0.5, math.log(3)]])
    mask = jnp.array([[True, True]])
    greedy = dspark_loss(d, t, jnp.array([[0, 1]]), z, mask, confidence_label="greedy")
    soft = dspark_loss(d, t, jnp.array([[0, 1]]), z, mask)
    w0, w1 = 1.0, math.exp(-0.25)
    bce0 = -math.log(1 - 1 / (1 + math.exp(-0.5)))  # BCE(z=0.5, label 0)
    bce1 = -math.log(0.75)  # BCE(z=ln 3, label 1)
    assert abs(float(greedy.bce) - (w0 * bce0 + w1 * bce1) / (w0 + w1)) < 1e-5
    # Only the BCE target changes: CE, L1 and the probabilistic tau are the soft run's.
    for k in ("ce", "l1", "tau_probabilistic"):
        assert float(getattr(greedy, k)) == float(getattr(soft, k))
    assert float(greedy.bce) != float(soft.bce)
    with pytest.raises(ValueError, match="confidence_label"):
        dspark_loss(d, t, jnp.array([[0, 1]]), z, mask, confidence_label="hard")


def test_conditional_confidence_label_scores_only_after_a_matched_prefix():
    # Two blocks of gamma=3, vocab 3 (argmax shown; all z = 0.3, so every BCE is a known constant):
    #   block 0: match, miss, match  -> slots 0 and 1 scored (slot 2 sits behind a miss)
    #   block 1: miss, match, match  -> slot 0 scored only
    hit, miss = [0.0, 2.0, 0.0], [2.0, 0.0, 0.0]
    t = jnp.array([[hit, hit, hit], [hit, hit, hit]])
    d = jnp.array([[hit, miss, hit], [miss, hit, hit]])
    z = jnp.full((2, 3), 0.3)
    mask = jnp.ones((2, 3), bool)
    out = dspark_loss(d, t, jnp.ones((2, 3), jnp.int32), z, mask, confidence_label="conditional")
    e = lambda k: math.exp(-k / 4)
    b1 = -math.log(1 / (1 + math.exp(-0.3)))  # BCE(z=0.3, label 1)
    b0 = -math.log(1 - 1 / (1 + math.exp(-0.3)))  # BCE(z=0.3, label 0)
    scored = e(0) * b1 + e(1) * b0 + e(0) * b0  # block 0 slots 0, 1; block 1 slot 0
    denom = 2 * (e(0) + e(1) + e(2))  # the shared normaliser of every term
    assert abs(float(out.bce) - scored / denom) < 1e-6
    greedy = dspark_loss(d, t, jnp.ones((2, 3), jnp.int32), z, mask, confidence_label="greedy")
    every = 2 * e(0) * 0 + e(0) * b1 + e(1) * b0 + e(2) * b1 + e(0) * b0 + e(1) * b1 + e(2) * b1
    assert abs(float(greedy.bce) - every / denom) < 1e-6
