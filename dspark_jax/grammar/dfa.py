"""The token DFA on the device: masking logits by a state and walking the table over tokens.

GrammarState holds the table rows of every resident grammar (a state is a row: the table's
entries are rows, -1 where a token is not allowed) and each engine slot's current row, -1 for a
slot without a grammar, whose logits pass untouched.  A walk over a token that is not allowed
leaves the row where it was: such a token is never committed (its probability is 0), and the
rows after it in a verify window only score drafts that are rejected anyway.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GrammarState(NamedTuple):
    table: jax.Array  # [rows, V] int32 the row after each token (-1: not allowed)
    row: jax.Array  # [slots] int32 each slot's current row (-1: no grammar)


def allocate_grammar_state(rows: int, slots: int, vocab: int) -> GrammarState:
    return GrammarState(jnp.full((rows, vocab), -1, jnp.int32), jnp.full((slots,), -1, jnp.int32))


def slot_rows(g: GrammarState, slot: jax.Array) -> jax.Array:
    """[N] the current row of each slot (-1 where slot is -1 or the slot has no grammar)."""
    return jnp.where(slot >= 0, g.row[jnp.clip(slot, 0, g.row.shape[0] - 1)], -1)


def mask(logits: jax.Array, g: GrammarState, rows: jax.Array) -> jax.Array:
    """logits [N, V] with the tokens row [N] does not allow at -inf (rows -1: untouched)."""
    allowed = g.table[jnp.maximum(rows, 0)] >= 0
    return jnp.where(allowed | (rows < 0)[:, None], logits, -jnp.inf)


def advance(g: GrammarState, rows: jax.Array, tokens: jax.Array, valid: jax.Array | bool = True) -> jax.Array:
    """[N] rows after one token each where valid (a disallowed token or row -1: unchanged)."""
    nxt = g.table[jnp.maximum(rows, 0), tokens.astype(jnp.int32)]
    return jnp.where(valid & (rows >= 0) & (nxt >= 0), nxt, rows)


def walk(g: GrammarState, rows: jax.Array, tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """[N] rows after the valid tokens of tokens [N, W] (taken in order)."""
    for w in range(tokens.shape[1]):
        rows = advance(g, rows, tokens[:, w], valid[:, w])
    return rows


def commit(g: GrammarState, slot: jax.Array, tokens: jax.Array, valid: jax.Array) -> GrammarState:
    """Each slot's row walked over its committed tokens [N, W] (where valid; slot -1: none)."""
    rows = walk(g, slot_rows(g, slot), tokens, valid)
    idx = jnp.where(slot >= 0, slot, g.row.shape[0])
    return g._replace(row=g.row.at[idx].set(rows, mode="drop"))
