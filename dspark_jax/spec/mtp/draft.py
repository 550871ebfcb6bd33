"""Chain drafting on a packed batch: one extend forward, then k - 1 single-row steps under lax.scan.

The drafter's KV cache mirrors the target's: row p holds the drafter's K/V of the pair
(h_p, x_{p+1}), in the same pages at the same slots, so it is valid exactly where the target's
cache is.  One drafting call per request therefore takes the rows the target just committed:

- after prefill: every prompt row p = 0..n-1 with its hidden state and x_{p+1} (the last
  x_{p+1} being the first sampled token, the anchor);
- after a verify round with a accepted drafts: the a + 1 kept rows (anchor + accepted), paired
  with the accepted drafts and the bonus token.  These overwrite the slots the previous round's
  chain steps wrote with the drafter's own guesses, as SGLang's draft-extend does.

The last extend row's output gives draft 1.  Step j = 2..k then runs one row per request at
position kv_len - 2 + j on (ĥ, draft j-1); its K/V are written past the committed length and are
simply overwritten next round (nothing needs cropping: the cache is read up to kv_lens only).
So page tables must cover kv_len + k - 1 tokens, which the verify step's pages already do.

Drafts are sampled per request: greedy at temperature 0, else from softmax(logits / T).  The
logits are returned before temperature, for the verifier's q = softmax(logits / T).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.forward_batch import ForwardBatch, build_forward_batch
from dspark_jax.grammar import dfa
from dspark_jax.kv_cache import KVCache
from dspark_jax.models.qwen3 import Qwen3ForCausalLM
from dspark_jax.spec.mtp.model import MTPDrafter

_DRAFT_SALT = 0x6D7470  # "mtp": keeps draft randomness independent of the target's sampling keys


class ChainDraft(NamedTuple):
    tokens: jax.Array  # [S, k] int32
    logits: jax.Array  # [S, k, V] fp32 draft logits before temperature
    hidden: jax.Array  # [S, k, d] drafter output ĥ of each step (what the next step was fed)


def draft_keys(seeds, positions) -> jax.Array:
    """Per-request keys: fold_in(PRNGKey(seed), position of the first draft), salted.

    As in dspark_jax.sampling, a request's drafts depend only on its seed and position, never on
    its batch neighbours; the salt keeps them independent of the target's key for that position."""
    key = lambda s, p: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), p), _DRAFT_SALT)
    return jax.vmap(key)(jnp.asarray(seeds, jnp.uint32), jnp.asarray(positions, jnp.int32))


def build_draft_batch(requests, *, num_steps: int, page_size: int, num_tokens: int, num_seqs: int,
                      pages_per_seq: int, hidden_size: int, dtype=np.float32):
    """Host packing of one drafting call -> (ForwardBatch, hidden [num_tokens, d]).

    ``requests``: per request (hidden [n, d], next_ids [n], cached rows, page ids) with n >= 1;
    hidden row i is the target's final-normed state at position cached + i, next_ids[i] the token
    at cached + i + 1.  Checks that the pages also cover the k - 1 chain positions."""
    hidden = np.zeros((num_tokens, hidden_size), dtype)
    t = 0
    for s, (h, ids, cached, pages) in enumerate(requests):
        h = np.asarray(h)
        if len(ids) < 1 or h.shape != (len(ids), hidden_size):
            raise ValueError(f"request {s}: need n >= 1 rows with hidden [n, {hidden_size}], "
                             f"got {h.shape} for {len(ids)} ids")
        need = -(-(cached + len(ids) + num_steps - 1) // page_size)
        if need > len(pages):
            raise ValueError(f"request {s}: {num_steps} draft steps after {cached + len(ids)} rows "
                             f"need {need} pages, got {len(pages)}")
        hidden[t : t + len(ids)] = h
        t += len(ids)
    batch = build_forward_batch([(np.asarray(ids), cached, pages) for _, ids, cached, pages in requests],
                                page_size=page_size, num_tokens=num_tokens, num_seqs=num_seqs,
                                pages_per_seq=pages_per_seq, logits_rows="last", num_logits=num_seqs)
    return batch, hidden


def _step_batch(batch: ForwardBatch, tokens: jax.Array, step: jax.Array, page_size: int) -> ForwardBatch:
    """Device-side batch of chain step `step` (1..k-1): one row per request, one position further."""
    S, P = batch.page_table.shape
    live = jnp.arange(S) < batch.num_seqs
    pos = batch.kv_lens - 1 + step
    page = jnp.take_along_axis(batch.page_table, jnp.clip(pos // page_size, 0, P - 1)[:, None], axis=1)[:, 0]
    slot = jnp.where(live, page * page_size + pos % page_size, jnp.arange(S) % page_size)  # padding -> page 0
    return ForwardBatch(
        input_ids=jnp.where(live, tokens, 0),
        positions=jnp.where(live, pos, 0),
        slot_mapping=slot.astype(jnp.int32),
        cu_q_lens=jnp.minimum(jnp.arange(S + 1, dtype=jnp.int32), batch.num_seqs),
        kv_lens=jnp.where(live, batch.kv_lens + step, 0),
        page_table=batch.page_table,
        num_seqs=batch.num_seqs,
        logits_indices=jnp.arange(S, dtype=jnp.int32),
    )


def _sample(logits, temperature, keys, grammar=None):
    """(token, the logits it was drawn from): masked by the grammar's rows where given."""
    if grammar is not None:
        logits = dfa.mask(logits, *grammar)
    greedy = jnp.argmax(logits, -1).astype(jnp.int32)
    drawn = jax.vmap(jax.random.categorical)(keys, logits / jnp.maximum(temperature, 1e-6)[:, None])
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy), logits


def draft_chain(drafter: MTPDrafter, target: Qwen3ForCausalLM, cache: KVCache, batch: ForwardBatch,
                hidden: jax.Array, temperature: jax.Array, keys: jax.Array, *, num_steps: int,
                backend: str = "reference", unroll: bool = False, grammar=None) -> tuple[ChainDraft, KVCache]:
    """k = num_steps chain drafts per request -> (ChainDraft, updated drafter cache).

    batch: built by build_draft_batch (or build_forward_batch with logits_rows="last" and
    num_logits = num_seqs); hidden [T, d] aligned with its rows; temperature [S] (0 = greedy);
    keys [S] per-request PRNG keys (draft_keys).  Rows of padding requests return garbage.
    unroll: the k - 1 steps as straight-line code instead of a while loop (the GPU serving path,
    spec/dspark/step.py).  grammar: (GrammarState, each request's DFA row [S]) of a constrained
    round: each step's logits are masked by the row after the drafts before it (and returned so)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    S = batch.page_table.shape[0]
    if batch.logits_indices.shape[0] != S:
        raise ValueError("the draft batch must select one (last) row per request: logits_rows='last', num_logits=num_seqs")
    batch = ForwardBatch(*(jnp.asarray(a) for a in batch))
    page_size = cache.page_size
    step_keys = jax.vmap(lambda k: jax.random.split(k, num_steps))(keys)  # [S, k]

    h_all, cache = drafter.paged(target, hidden.astype(drafter.fc.kernel[...].dtype), batch, cache, backend=backend)
    h = h_all[batch.logits_indices]
    g, rows = grammar if grammar is not None else (None, jnp.zeros((S,), jnp.int32))
    masked = lambda r: None if g is None else (g, r)
    tok, logits = _sample(target.logits(h.astype(target.dtype)), temperature, step_keys[:, 0], masked(rows))
    if g is not None:
        rows = dfa.advance(g, rows, tok)

    def body(carry, step):
        h, tok, rows, kc, vc = carry
        sb = _step_batch(batch, tok, step, page_size)
        h_new, c = drafter.paged(target, h, sb, KVCache(kc, vc), backend=backend)
        new_tok, lg = _sample(target.logits(h_new.astype(target.dtype)), temperature, step_keys[:, step], masked(rows))
        if g is not None:
            rows = dfa.advance(g, rows, new_tok)
        return (h_new, new_tok, rows, c.k, c.v), (new_tok, lg, h_new)

    (_, _, _, kc, vc), (toks, lgs, hs) = jax.lax.scan(
        body, (h, tok, rows, cache.k, cache.v), jnp.arange(1, num_steps, dtype=jnp.int32), unroll=bool(unroll))
    tokens = jnp.concatenate([tok[:, None], jnp.moveaxis(toks, 0, 1)], axis=1)
    logits = jnp.concatenate([logits[:, None], jnp.moveaxis(lgs, 0, 1)], axis=1)
    hidden_out = jnp.concatenate([h[:, None], jnp.moveaxis(hs, 0, 1)], axis=1)
    return ChainDraft(tokens, logits, hidden_out), KVCache(kc, vc)
