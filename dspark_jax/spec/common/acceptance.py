"""Verification rules: which drafts a request commits, and the bonus token after them.

For a request that verified its anchor plus l drafts, row i of the target's logits is the
target distribution p_i of the token after verify input i (input 0 is the anchor), so draft k
(1-indexed) is judged against p_{k-1}:

- greedy (temperature 0): accept draft k iff it equals argmax p_{k-1};
- sampling: accept draft k iff u_k < min(1, p_{k-1}(x_k) / q_k(x_k)), q_k the tempered
  Markov-corrected draft distribution the draft was sampled from (Leviathan/Chen).

a = number of leading accepts (at most l).  The bonus comes from norm(max(0, p_a - q_{a+1})) after
a rejection (p_a itself if that residual has no mass) and from p_l when every verified draft was
accepted: drafts past l were never scored and are simply discarded.  The committed tokens then
follow the target's own distribution exactly, whatever l was, provided l was not chosen by
looking at whether drafts would be accepted.

p is the target's distribution after the request's own temperature / top-k / top-p processing,
so speculative output matches plain sampling with the same settings.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.sampling import _filtered_logits


def target_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """p per row: logits [N, V] and each row's own settings [N] -> the filtered, tempered
    distribution [N, V] fp32.  Its top-k / top-p filter sorts the vocabulary of every row, so a
    verify step applies it to the rows it verified, front-packed, before spreading them per
    request: the work then shrinks with the verify budget."""
    return jax.nn.softmax(_filtered_logits(logits.astype(jnp.float32), temperature, top_k, top_p), axis=-1)


class Acceptance(NamedTuple):
    num_accepted: jax.Array  # [S] int32 drafts accepted (a)
    bonus: jax.Array  # [S] int32 token committed after them
    block_accept: jax.Array  # [S] int32 drafts that full verification would accept (cap-accept ceiling - 1)


def verify(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_logits: jax.Array,
    verify_lens: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
    *,
    commit_cap: jax.Array | None = None,
    probs: jax.Array | None = None,
) -> Acceptance:
    """target_logits [S, W, V] (row i after verify input i; rows >= verify_lens are ignored),
    draft_tokens [S, gamma], draft_logits [S, gamma, V] (corrected, untempered), verify_lens [S]
    counting the anchor (1..gamma+1), per-request sampling settings, keys [S] PRNG keys.

    commit_cap [S] (cap-accept mode): judge all verify_lens rows but commit at most
    commit_cap - 1 drafts; block_accept then reports what full verification accepted.
    probs [S, W, V]: that distribution already computed (``target_probs`` of each row, e.g. on
    the packed rows of a verify step); None: computed here from target_logits."""
    S, W, V = target_logits.shape
    G = draft_tokens.shape[1]
    verified = jnp.arange(G)[None, :] < (verify_lens - 1)[:, None]
    greedy_ok = draft_tokens == jnp.argmax(target_logits[:, :G], axis=-1)

    def accepted(ok):
        block_accept = jnp.cumprod((ok & verified).astype(jnp.int32), axis=1).sum(1).astype(jnp.int32)
        return block_accept, (block_accept if commit_cap is None else jnp.minimum(block_accept, commit_cap - 1))

    def greedy_bonus(a):
        return jnp.argmax(jnp.take_along_axis(target_logits, a[:, None, None], axis=1)[:, 0], -1).astype(jnp.int32)

    greedy_row = temperature <= 0
    if probs is None:  # target distribution per row, with the request's filters (rows flattened)
        rep = lambda x: jnp.repeat(x, W)
        probs = target_probs(target_logits.reshape(S * W, V), rep(temperature), rep(top_k), rep(top_p)).reshape(S, W, V)
    p = probs
    q = jax.nn.softmax(draft_logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None, None], axis=-1)
    k_accept, k_bonus = jax.vmap(lambda k: jax.random.split(k, 2), out_axes=1)(keys)
    u = jax.vmap(lambda k: jax.random.uniform(k, (G,)))(k_accept)

    p_prev = p[:, :G]  # p_{k-1} for drafts k = 1..G
    px = jnp.take_along_axis(p_prev, draft_tokens[..., None], -1)[..., 0]
    qx = jnp.take_along_axis(q, draft_tokens[..., None], -1)[..., 0]
    sampled_ok = u < jnp.minimum(1.0, px / jnp.maximum(qx, 1e-8))
    block_accept, a = accepted(jnp.where(greedy_row[:, None], greedy_ok, sampled_ok))

    # Bonus: residual after a rejection at draft a+1, else the target row a.
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]
    q_next = jnp.take_along_axis(q, jnp.minimum(a, G - 1)[:, None, None], axis=1)[:, 0]
    rejected = a < (verify_lens - 1) if commit_cap is None else a < jnp.minimum(verify_lens, commit_cap) - 1
    residual = jnp.maximum(p_a - q_next, 0.0)
    mass = residual.sum(-1, keepdims=True)
    use_residual = (rejected & ~greedy_row)[:, None] & (mass > 1e-8)
    dist = jnp.where(use_residual, residual / jnp.maximum(mass, 1e-30), p_a)
    drawn = jax.vmap(lambda k, d: jax.random.categorical(k, jnp.log(d)))(k_bonus, dist).astype(jnp.int32)
    bonus = jnp.where(greedy_row, greedy_bonus(a), drawn)
    return Acceptance(a.astype(jnp.int32), bonus, block_accept)
