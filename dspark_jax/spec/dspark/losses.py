"""DSpark training objective: 0.1 CE + 0.9 L1 + 1.0 BCE(confidence, soft acceptance label).

Per block position k (0-indexed) the weight is w_k = eval_mask_k * exp(-k / decay) with
decay = 4 (DeepSpec's loss_decay_gamma, not the block size), where eval_mask is made
prefix-contiguous: a position whose label is invalid also invalidates every later one.  Each
term is a weighted mean sum(w * term) / sum(w), as DeepSpec computes it (the paper's equations
write plain sums).

- CE on the corrected draft logits (Markov bias included) against the ground-truth token;
- L1 = || softmax(draft) - softmax(target) ||_1, the full L1 (= 2 TV), at temperature 1;
- BCE of the confidence logit against c* = 1 - L1/2, the analytic probability that a draft
  sampled from the draft distribution survives rejection sampling against the target; the label
  is detached so the confidence head learns to predict acceptance, not to move it.

``confidence_label="greedy"`` swaps that label for the greedy one, 1{argmax draft = argmax
target}: the event that decides acceptance at temperature 0.  The soft label is the T=1
acceptance probability and overstates greedy acceptance where the two distributions share their
mode but not their shape (and understates it where they differ only in the tail), so a head
trained on it stays miscalibrated at T=0 in ways one temperature per position (STS) cannot undo.
A head fine-tuned on greedy labels (training.drafter ``--trainable confidence``) targets the
quantity the T=0 scheduler consumes.

``confidence_label="conditional"`` keeps the greedy label but scores slot k only where every
earlier slot's draft matched (``conditional_weights``).  The scheduler multiplies the head's
outputs, Π_{i≤k} σ(z_i), so each factor must be P(slot k accepted | slots < k accepted); a head
trained on every slot learns the *unconditional* match rate instead, which is lower (a block
whose early drafts are right sits in easier text), and the product comes out under-confident
by more at every later position -- the embedded head's STS temperatures fall from 0.89 at slot 1
to 0.25 at slot 7 trying to sharpen it back, and one temperature per slot cannot do that for
workloads whose correlation differs.  Teacher forcing makes the conditional label exact at T=0:
the Markov head's previous token is the ground truth, which is the draft whenever the prefix
matched.  This is a deviation from DSpark's soft-label BCE, for the T=0 calibration that STS is
fitted and judged on.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

CE_WEIGHT, L1_WEIGHT, CONF_WEIGHT, DECAY = 0.1, 0.9, 1.0, 4.0
CONFIDENCE_LABELS = ("soft", "greedy", "conditional")


class LossTerms(NamedTuple):
    loss: jax.Array
    ce: jax.Array
    l1: jax.Array
    bce: jax.Array
    tau_probabilistic: jax.Array  # mean over valid blocks of 1 + sum_k prod_{i<=k} c*_i
    accept_rate: jax.Array  # [gamma] weighted mean c* per position


def bce_with_logits(z: jax.Array, target) -> jax.Array:
    """Elementwise binary cross-entropy of logits z against target probabilities (stable form)."""
    return jnp.maximum(z, 0) - z * target + jnp.log1p(jnp.exp(-jnp.abs(z)))


def position_weights(eval_mask: jax.Array, decay: float = DECAY) -> jax.Array:
    """eval_mask [..., gamma] bool -> prefix-contiguous mask times exp(-k / decay)."""
    prefix = jnp.cumprod(eval_mask.astype(jnp.float32), axis=-1)
    k = jnp.arange(eval_mask.shape[-1], dtype=jnp.float32)
    return prefix * jnp.exp(-k / decay)


def greedy_match(draft_logits: jax.Array, target_logits: jax.Array) -> jax.Array:
    """1.0 where the draft's argmax equals the target's argmax (acceptance at T=0), fp32."""
    return (jnp.argmax(draft_logits, -1) == jnp.argmax(target_logits, -1)).astype(jnp.float32)


def conditional_weights(w: jax.Array, match: jax.Array) -> jax.Array:
    """w [..., gamma] kept only where every earlier slot matched: exclusive cumprod of match."""
    before = jnp.cumprod(jnp.concatenate([jnp.ones_like(match[..., :1]), match[..., :-1]], -1), axis=-1)
    return w * before


def soft_acceptance(draft_logits: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(L1 distance [...], detached label c* = clip(1 - L1/2, 0, 1)) at temperature 1, in fp32."""
    p = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1)
    q = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    l1 = jnp.abs(p - q).sum(-1)
    return l1, jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))


def dspark_loss(
    draft_logits: jax.Array,
    target_logits: jax.Array,
    labels: jax.Array,
    confidence_logits: jax.Array,
    eval_mask: jax.Array,
    *,
    weights: tuple[float, float, float] = (CE_WEIGHT, L1_WEIGHT, CONF_WEIGHT),
    decay: float = DECAY,
    confidence_label: str = "soft",
    confidence_blocks: jax.Array | None = None,
) -> LossTerms:
    """draft/target logits [..., gamma, V]; labels [..., gamma] (token after each position);
    confidence_logits and eval_mask [..., gamma].  confidence_label: "soft" (c*), "greedy"
    (argmax agreement) or "conditional" (argmax agreement, scored only after a matched prefix) as
    the BCE target; the other terms and tau_probabilistic keep c*.  The BCE stays a sum over its
    scored slots divided by the same sum(w) as the other terms.  confidence_blocks [...] (0/1 per
    block) limits the BCE to those blocks, e.g. the blocks where speculative rounds start."""
    if confidence_label not in CONFIDENCE_LABELS:
        raise ValueError(f"confidence_label must be one of {CONFIDENCE_LABELS}, got {confidence_label!r}")
    w = position_weights(eval_mask, decay)
    denom = jnp.maximum(w.sum(), 1e-9)
    mean = lambda x: (w * x).sum() / denom
    logp = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    l1, label = soft_acceptance(draft_logits, target_logits)
    z = confidence_logits.astype(jnp.float32)
    target, bce_w = label, w
    if confidence_label != "soft":
        target = greedy_match(draft_logits, target_logits)
    if confidence_label == "conditional":
        bce_w = conditional_weights(w, target * (w > 0))
    if confidence_blocks is not None:
        bce_w = bce_w * confidence_blocks[..., None]
    bce = (bce_w * bce_with_logits(z, target)).sum() / denom
    terms = (mean(ce), mean(l1), bce)
    loss = sum(a * t for a, t in zip(weights, terms))
    valid = (w[..., 0] > 0).astype(jnp.float32)
    prefix = jnp.where(w > 0, label, 0.0)
    tau = (valid * (1.0 + jnp.cumprod(prefix, axis=-1).sum(-1))).sum() / jnp.maximum(valid.sum(), 1.0)
    pos_mask = (w > 0).astype(jnp.float32).reshape(-1, w.shape[-1])
    acc = (label.reshape(-1, w.shape[-1]) * pos_mask).sum(0) / jnp.maximum(pos_mask.sum(0), 1.0)
    return LossTerms(loss, *terms, tau, acc)
