"""The MTP (EAGLE-style chain) speculative steps as pure functions over explicit state.

The drafter's row p reads the pair (h_p, x_{p+1}): the target's final-normed hidden state at p
and the token after it (dspark_jax/spec/mtp/draft.py).  When the target verifies a round, the pairs
of the rows it keeps are complete only once acceptance has picked the bonus token, and the
drafter's output on the last of them is what proposes the next round's first draft.  So a
round *begins* with the drafter extend over the rows the previous call committed, and those
rows are carried between calls on device, per request slot:

    Pending(hidden [slots, k + 1, d], next_ids [slots, k + 1], count [slots])

- after prefill, one row: the prompt's last hidden state paired with the sampled first token
  (the prompt's other rows, whose next tokens are known, go into the drafter cache at once);
- after a round that accepted a drafts, the a + 1 kept rows (anchor + accepted), paired with
  the accepted drafts and the bonus.

Carrying the rows (d floats each, at most k + 1 per slot) costs a few MB at most and no
recompute; reading them to the host and back would put hidden states on the critical path.
(Extending at the end of a round and carrying only the drafter's last output would save the
buffer but not compute, and would split the chain across two calls.)

mtp_spec_step, one round for a batch of requests:
  drafter extend over the carried rows + k - 1 chain steps (draft_chain)
  -> verify anchor + k drafts per request (static: k + 1 rows each, front-packed into the tier)
  -> accept (dspark_jax/spec/common/acceptance.verify: exact match at T = 0, speculative sampling
     with the chain's logits as q at T > 0)
  -> carry the kept rows' hidden states and next ids for the next round.
Only the drafts, the accept counts and the bonus go back to the host.  A processed round (lstate
given) verifies against each row's processed target distribution and also returns the
committed tokens' raw logprobs (dspark_jax/logit_processors.py); a constrained one (lstate with
the grammar state) also masks each chain step by the DFA state after the drafts before it.

Random keys are derived per request from (seed, anchor position), so outputs do not depend on
batch composition.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.forward_batch import ForwardBatch
from dspark_jax.kv_cache import KVCache
from dspark_jax.logit_processors import LogitState, commit_window, draft_grammar, process_window, sample_processed
from dspark_jax.logprobs import TokenLogprobs, logprob_shapes
from dspark_jax.spec.common.acceptance import verify
from dspark_jax.spec.common.inputs import RoundBatch, round_inputs
from dspark_jax.spec.common.packing import front_pack, packed_rows, unpack_rows
from dspark_jax.spec.mtp.draft import draft_chain, draft_keys

_VERIFY_STREAM = 2  # fold_in stream of the acceptance / bonus keys (as the DSpark step's)


class Pending(NamedTuple):
    """Rows committed by the target but not yet fed to the drafter, per request slot."""

    hidden: jax.Array  # [slots, k + 1, d] the target's final-normed h of each row
    next_ids: jax.Array  # [slots, k + 1] int32 the token after each row
    count: jax.Array  # [slots] int32 rows held (1..k + 1 for a decoding slot)


def allocate_pending(num_slots: int, num_steps: int, hidden_size: int, dtype) -> Pending:
    return Pending(jnp.zeros((num_slots, num_steps + 1, hidden_size), dtype),
                   jnp.zeros((num_slots, num_steps + 1), jnp.int32), jnp.zeros((num_slots,), jnp.int32))


@round_inputs
class MTPInputs(RoundBatch):
    slot: jax.Array  # [S] int32 the request's row of Pending

    @classmethod
    def shapes(cls, rows: int, pages: int) -> MTPInputs:
        """Abstract inputs of a round executable: S rows, P-page tables."""
        return cls(**RoundBatch.shapes(rows, pages), slot=jax.ShapeDtypeStruct((rows,), np.int32))


class MTPOutputs(NamedTuple):
    drafts: jax.Array  # [S, k]
    num_accepted: jax.Array  # [S] drafts committed
    bonus: jax.Array  # [S]
    verify_lens: jax.Array  # [S] rows verified (anchor included): k + 1
    block_accept: jax.Array  # [S] drafts accepted (= num_accepted: a chain verifies everything)
    # raw logprobs of the token committed after each row ([S, k + 1], [S, k + 1, K]; zero-size
    # outside processed rounds)
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array

    @classmethod
    def result_shapes(cls, rows: int, k: int, top: int = 0) -> MTPOutputs:
        """Abstract results of a round (top: the logprob alternatives of a processed round, else 0)."""
        s, i32, S = jax.ShapeDtypeStruct, np.int32, rows
        lp = logprob_shapes(S, width=k + 1 if top else 0, k=top)
        return cls(drafts=s((S, k), i32), num_accepted=s((S,), i32), bonus=s((S,), i32), verify_lens=s((S,), i32),
                   block_accept=s((S,), i32), **lp._asdict())

    @property
    def logprobs(self) -> TokenLogprobs:
        return TokenLogprobs(self.logprob, self.top_ids, self.top_logprobs)


def _verify_keys(seed, position):
    key = lambda s, p: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), p), _VERIFY_STREAM)
    return jax.vmap(key)(seed, position)


def _drop_index(slot, valid, num_slots: int):
    """Scatter index into Pending: out of bounds (dropped with mode="drop") where not valid."""
    return jnp.where(valid & (slot >= 0), slot, num_slots).astype(jnp.int32)


def extend_batch(pending: Pending, inp: MTPInputs, *, num_tokens: int, page_size: int):
    """Device-side drafting batch of the carried rows -> (ForwardBatch, hidden [T, d]).

    Request i's rows sit at positions start - count .. start - 1 (they end right before its
    anchor), front-packed as in a verify buffer; the last row of each request is its logits row."""
    num_slots, W = pending.next_ids.shape
    slot = jnp.clip(inp.slot, 0, num_slots - 1)
    counts = jnp.where(inp.live, pending.count[slot], 0).astype(jnp.int32)
    req, within, valid = packed_rows(counts, num_tokens)
    w = jnp.clip(within, 0, W - 1)
    hidden = jnp.where(valid[:, None], pending.hidden[slot[req], w], 0)
    ids = jnp.where(valid, pending.next_ids[slot[req], w], 0)
    pos = jnp.where(valid, inp.start[req] - counts[req] + within, 0)
    P = inp.page_table.shape[1]
    page = jnp.take_along_axis(inp.page_table[req], jnp.clip(pos // page_size, 0, P - 1)[:, None], 1)[:, 0]
    sentinel = jnp.arange(num_tokens, dtype=jnp.int32) % page_size  # slots of page 0
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
    batch = ForwardBatch(
        input_ids=ids.astype(jnp.int32),
        positions=pos.astype(jnp.int32),
        slot_mapping=jnp.where(valid, page * page_size + pos % page_size, sentinel).astype(jnp.int32),
        cu_q_lens=cu,
        kv_lens=jnp.where(inp.live, inp.start, 0).astype(jnp.int32),
        page_table=inp.page_table,
        num_seqs=jnp.asarray(inp.num_seqs, jnp.int32).reshape(()),
        logits_indices=jnp.maximum(cu[1:] - 1, 0),
    )
    return batch, hidden


def mtp_spec_step(target_def, drafter_def, target_state, drafter_state, tcache: KVCache, dcache: KVCache,
                  pending: Pending, lstate: LogitState | None, inp: MTPInputs, *, num_tokens: int, page_size: int,
                  target_options: dict):
    """One round -> (MTPOutputs, tcache, dcache, pending, lstate).  The caches, Pending and the
    logit-processor state (a processed round's; else None) are donated.
    target_options: the target forward's keyword options (ModelRunner.forward_options); the
    drafter runs with the same attention backend and unrolls its loops where the target does.

    k (the chain length) is Pending's width - 1; num_tokens (the tier) must hold S * (k + 1)."""
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state)
    num_slots, W = pending.next_ids.shape
    k = W - 1
    backend, unroll = target_options["backend"], not target_options["scan_layers"]

    # 1. Draft: extend over the carried rows, then k - 1 chain steps.
    eb, hidden = extend_batch(pending, inp, num_tokens=num_tokens, page_size=page_size)
    chain, dcache = draft_chain(drafter, target, dcache, eb, hidden, inp.temperature,
                                draft_keys(inp.seed, inp.start + 1), num_steps=k, backend=backend, unroll=unroll,
                                grammar=draft_grammar(lstate, jnp.where(inp.live, inp.logit_slot, -1)))

    # 2. Verify the anchor and all k drafts of every request.
    verify_lens = jnp.where(inp.live, W, 0).astype(jnp.int32)
    fb = front_pack(inp.anchor, chain.tokens, verify_lens, inp.start, inp.page_table, inp.num_seqs,
                    num_tokens=num_tokens, page_size=page_size)
    out = target(tcache, fb, **target_options)
    # Each row's processed distribution (processed rounds; else the raw logits).
    verified = process_window(out.logits, lstate, inp.logit_slot, inp.start, chain.tokens, verify_lens, num_tokens)
    logits = unpack_rows(verified, verify_lens, W)

    # 3. Accept.
    acc = verify(logits, chain.tokens, chain.logits, jnp.maximum(verify_lens, 1), inp.temperature, inp.top_k,
                 inp.top_p, _verify_keys(inp.seed, inp.start))
    lp, lstate = commit_window(lstate, inp.logit_slot, inp.live, out.logits, verify_lens, chain.tokens,
                               acc.num_accepted, acc.bonus)

    # 4. Carry the kept rows (anchor + accepted drafts), paired with the accepted drafts and the bonus.
    a = acc.num_accepted
    kept_h = unpack_rows(out.hidden, verify_lens, W).astype(pending.hidden.dtype)  # [S, W, d]
    drafts_w = jnp.concatenate([chain.tokens, jnp.zeros_like(chain.tokens[:, :1])], axis=1)
    kept_next = jnp.where(jnp.arange(W)[None, :] < a[:, None], drafts_w, acc.bonus[:, None]).astype(jnp.int32)
    idx = _drop_index(inp.slot, inp.live, num_slots)
    pending = Pending(pending.hidden.at[idx].set(kept_h, mode="drop"),
                      pending.next_ids.at[idx].set(kept_next, mode="drop"),
                      pending.count.at[idx].set(a + 1, mode="drop"))
    res = MTPOutputs(chain.tokens, a, acc.bonus, verify_lens, acc.block_accept, *lp)
    return res, out.cache, dcache, pending, lstate


def mtp_prefill_step(target_def, drafter_def, target_state, drafter_state, tcache: KVCache, dcache: KVCache,
                     pending: Pending, lstate: LogitState | None, batch: ForwardBatch, sampling, next_ids, final_slot,
                     *, target_options: dict):
    """Target prefill of prompt chunks + drafter extend; the first token is sampled.

    next_ids [T]: the prompt token after each row (the host knows it, except after the last row
    of a prompt that this chunk completes); final_slot [S]: the Pending slot of each sequence
    whose prompt this chunk completes, -1 otherwise.  Every row goes into the drafter cache,
    a completed prompt's last row paired with the sampled token; that row is also carried in
    Pending, because the first round needs the drafter's output on it (the round's extend
    writes the same K/V again).  The token is processed, with its logprobs, where the engine runs
    logit processors (lstate given; sampling then ends with the rows' logit slots).
    -> (tokens [S], logprobs, tcache, dcache, pending, lstate)."""
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state)
    out = target(tcache, batch, **target_options)
    tokens, lp, lstate = sample_processed(out.logits, sampling[:5], lstate, sampling[5] if lstate is not None else None)
    T, num_slots = batch.input_ids.shape[0], pending.count.shape[0]
    final = final_slot >= 0
    last = batch.logits_indices  # the last row of each sequence
    next_ids = jnp.asarray(next_ids, jnp.int32).at[jnp.where(final, last, T)].set(tokens, mode="drop")
    h = out.hidden.astype(drafter.fc.kernel[...].dtype)
    _, dcache = drafter.paged(target, h, batch._replace(input_ids=next_ids), dcache, backend=target_options["backend"])
    idx = _drop_index(final_slot, final, num_slots)
    pending = Pending(pending.hidden.at[idx, 0].set(out.hidden[last].astype(pending.hidden.dtype), mode="drop"),
                      pending.next_ids.at[idx, 0].set(tokens, mode="drop"),
                      pending.count.at[idx].set(1, mode="drop"))
    return tokens, lp, out.cache, dcache, pending, lstate
