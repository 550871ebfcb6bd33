"""The DSpark steps as pure functions over explicit state (jitted and compiled by the worker).

prefill_step: the target prefills prompt chunks with its tapped layers, the drafter's context
cache is extended with those rows, and the first token is sampled.

spec_step, one round for a batch of requests (mode "decode" or "decode-greedy": a plain decode
step instead, the target's next token of every anchor, whose row still extends the draft context):
  draft a block per request (drafter + sequential head + confidence)
  -> verify windows (static: the full block; compact / cap-accept: top-K of current survival,
     K chosen on the host from lagged survival)
  -> front-pack the windows into the tier buffer -> target verify (ragged paged attention)
  -> accept (exact match / speculative sampling) -> extend the draft context cache with the
     target's tapped hidden states of the anchor and accepted drafts.
Only the committed tokens (drafts[:a] + bonus) and small per-request statistics go back to the
host.  Random keys come per request from (seed, anchor position), so outputs do not depend on
batch composition.  A processed round (lstate given: a request in the batch uses logit
processors or logprobs) verifies against the processed target distribution of each window row
and returns the committed tokens' raw logprobs (dspark_jax/logit_processors.py); a constrained
one (its lstate holds the grammar state) also masks each drafted position by the DFA state after
the drafts before it, so q is the masked distribution the draft was sampled from.

Feeding: a round also returns each request's next anchor and position (padded to the engine's
slot count R, so every tier's executable shares one shape) and takes the previous round's as
``fed_anchor`` / ``fed_start``: row i reads row ``fed_index[i]`` of them, or the host's anchor
and start where it is -1.  The host dispatches round t+1 on those device arrays before reading
round t.  spec_rounds runs several rounds in one executable, each fed by the one before.
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
from dspark_jax.logprobs import TokenLogprobs, empty_logprobs, logprob_shapes
from dspark_jax.spec.common.acceptance import target_probs, verify
from dspark_jax.spec.common.inputs import RoundBatch, round_inputs
from dspark_jax.spec.common.packing import front_pack, packed_rows, topk_verify_lens, unpack_rows
from dspark_jax.spec.dspark.model import sample_block


@round_inputs
class SpecInputs(RoundBatch):
    budget: jax.Array  # [rounds] int32 extra verify tokens of each round (compact / cap-accept)
    fed_anchor: jax.Array  # [R] int32 the previous round's next_anchor (on the device)
    fed_start: jax.Array  # [R] int32 the previous round's next_start (on the device)
    fed_index: jax.Array  # [S] int32 row of the previous round feeding each row; -1: anchor / start

    @classmethod
    def shapes(cls, rows: int, pages: int, slots: int, rounds: int) -> SpecInputs:
        """Abstract inputs of a round executable: S rows, P-page tables, R feed slots."""
        s, i32 = jax.ShapeDtypeStruct, np.int32
        return cls(**RoundBatch.shapes(rows, pages), budget=s((rounds,), i32), fed_anchor=s((slots,), i32),
                   fed_start=s((slots,), i32), fed_index=s((rows,), i32))


FED_FIELDS = ("fed_anchor", "fed_start")  # left on the device by the previous round


DECODE_MODES = ("decode", "decode-greedy")  # a plain decode step in a round's place (sampling / all greedy)


def decode_mode(temperature) -> str:
    """The decode-round executable for rows with these temperatures: argmax-only when all are 0."""
    return "decode" if np.any(np.asarray(temperature) > 0) else "decode-greedy"


class SpecOutputs(NamedTuple):
    drafts: jax.Array  # [S, gamma]
    num_accepted: jax.Array  # [S] drafts committed
    bonus: jax.Array  # [S]
    verify_lens: jax.Array  # [S] window verified (anchor included)
    block_accept: jax.Array  # [S] drafts full verification would accept (exact in static/cap-accept)
    survival: jax.Array  # [S, gamma] calibrated cumulative survival (for the lag ring and metrics)
    confidence_logits: jax.Array  # [S, gamma] raw z (STS data collection)
    # raw logprobs of the token committed after each window row ([S, gamma + 1], [S, gamma + 1, K];
    # zero-size outside processed rounds)
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    next_anchor: jax.Array  # [R] the bonus token: the next round's anchor (0 past the live rows)
    next_start: jax.Array  # [R] its position: start + accepted + 1

    @classmethod
    def result_shapes(cls, rounds: int, rows: int, gamma: int, top: int = 0) -> SpecOutputs:
        """Abstract host-read results of a call of ``rounds`` rounds (the fed fields stay on the
        device: None); top: the logprob alternatives of a processed round (0: unprocessed).
        Confidences travel as float32 (exact for bf16)."""
        s, i32, f32, n, S, G = jax.ShapeDtypeStruct, np.int32, np.float32, rounds, rows, gamma
        lp = logprob_shapes(n, S, width=G + 1 if top else 0, k=top)
        return cls(drafts=s((n, S, G), i32), num_accepted=s((n, S), i32), bonus=s((n, S), i32),
                   verify_lens=s((n, S), i32), block_accept=s((n, S), i32), survival=s((n, S, G), f32),
                   confidence_logits=s((n, S, G), f32), **lp._asdict(), next_anchor=None, next_start=None)

    @property
    def logprobs(self) -> TokenLogprobs:
        return TokenLogprobs(self.logprob, self.top_ids, self.top_logprobs)


FED_OUTPUTS = ("next_anchor", "next_start")  # feed the next round on the device
RESULT_FIELDS = tuple(f for f in SpecOutputs._fields if f not in FED_OUTPUTS)  # read by the host


def _keys(seed, position, stream: int):
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), p), stream))(seed, position)


def block_batch(inp: SpecInputs, gamma: int, mask_token: int, page_size: int, drop_slot: int) -> ForwardBatch:
    """[anchor, MASK x (gamma-1)] per live request at anchor position + k."""
    S = inp.anchor.shape[0]
    k = jnp.arange(gamma, dtype=jnp.int32)
    ids = jnp.where(k[None] == 0, inp.anchor[:, None], mask_token)
    pos = inp.start[:, None] + k[None]
    page = jnp.take_along_axis(inp.page_table, jnp.clip(pos // page_size, 0, inp.page_table.shape[1] - 1), axis=1)
    # Padding requests' rows are not written (drop_slot; they are never read: kv_lens 0).
    slot = jnp.where(inp.live[:, None], page * page_size + pos % page_size, drop_slot)
    lens = jnp.where(inp.live, gamma, 0).astype(jnp.int32)
    return ForwardBatch(
        input_ids=jnp.where(inp.live[:, None], ids, 0).reshape(-1).astype(jnp.int32),
        positions=jnp.where(inp.live[:, None], pos, 0).reshape(-1).astype(jnp.int32),
        slot_mapping=slot.reshape(-1).astype(jnp.int32),
        cu_q_lens=jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens)]).astype(jnp.int32),
        kv_lens=jnp.where(inp.live, inp.start + gamma, 0).astype(jnp.int32),
        page_table=inp.page_table,
        num_seqs=inp.num_seqs,
        logits_indices=jnp.arange(S * gamma, dtype=jnp.int32),
    )


def spec_step(target_def, drafter_def, target_state, drafter_state, tcache: KVCache, dcache: KVCache,
              lstate: LogitState | None, inp: SpecInputs, sts_temperatures, *, mode: str, num_tokens: int,
              page_size: int, target_options: dict):
    """One round -> (SpecOutputs, tcache, dcache, lstate); inp.budget is this round's [] budget.
    target_options: the target forward's keyword options (ModelRunner.forward_options); the
    drafter runs with the same attention backend and unrolls its loops where the target does.
    lstate: the logit-processor state of a processed round (None: unprocessed)."""
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state)
    backend, unroll = target_options["backend"], not target_options["scan_layers"]
    cfg = drafter.config
    G, S = cfg.block_size, inp.anchor.shape[0]
    fed, row = inp.fed_index >= 0, jnp.maximum(inp.fed_index, 0)
    inp = inp.replace(anchor=jnp.where(fed, inp.fed_anchor[row], inp.anchor),
                      start=jnp.where(fed, inp.fed_start[row], inp.start))
    if mode in DECODE_MODES:
        return decode_step(target, drafter, tcache, dcache, lstate, inp, num_tokens=num_tokens, page_size=page_size,
                           target_options=target_options, greedy=mode == "decode-greedy")

    # 1. Draft.
    blk = block_batch(inp, G, cfg.mask_token_id, page_size, dcache.drop_slot)
    h, base, dcache = drafter.draft_block(target, dcache, blk, backend=backend, unroll=unroll)
    bs = sample_block(drafter, h.reshape(S, G, -1), base.reshape(S, G, -1), inp.anchor, inp.temperature,
                      _keys(inp.seed, inp.start, 1), unroll=unroll,
                      grammar=draft_grammar(lstate, jnp.where(inp.live, inp.logit_slot, -1)))
    survival = jnp.cumprod(jax.nn.sigmoid(bs.confidence / sts_temperatures[None, :]), axis=1)

    # 2. Windows: static verifies everything; compact / cap-accept take the top-K.
    full = jnp.where(inp.live, G + 1, 0).astype(jnp.int32)
    window = topk_verify_lens(survival, inp.budget, inp.live)
    verify_lens = window if mode == "compact" else full

    # 3. Target verify over the front-packed windows, tapping the drafter's layers.
    fb = front_pack(inp.anchor, bs.tokens, verify_lens, inp.start, inp.page_table, inp.num_seqs,
                    num_tokens=num_tokens, page_size=page_size)
    out = target(tcache, fb, tap_layers=cfg.target_layer_ids, **target_options)
    req, within, valid = packed_rows(verify_lens, num_tokens)
    # Each row's processed distribution (processed rounds; else the raw logits).
    verified = process_window(out.logits, lstate, inp.logit_slot, inp.start, bs.tokens, verify_lens, num_tokens)
    logits = unpack_rows(verified, verify_lens, G + 1)

    # 4. Accept.  The target's filtered distribution is computed on the packed rows (its
    # vocabulary sort then costs what the tier verifies, not the full block of every request).
    probs = unpack_rows(target_probs(verified, inp.temperature[req], inp.top_k[req], inp.top_p[req]),
                        verify_lens, G + 1)
    acc = verify(logits, bs.tokens, bs.logits, jnp.maximum(verify_lens, 1), inp.temperature, inp.top_k, inp.top_p,
                 _keys(inp.seed, inp.start, 2), commit_cap=window if mode == "cap-accept" else None, probs=probs)
    lp, lstate = commit_window(lstate, inp.logit_slot, inp.live, out.logits, verify_lens, bs.tokens,
                               acc.num_accepted, acc.bonus)

    # 5. Rows anchor..a of each request become draft context (their target hidden states).
    keep = valid & (within <= acc.num_accepted[req])
    ctx_slots = jnp.where(keep, fb.slot_mapping, dcache.drop_slot)  # rejected and padding rows: not written
    dcache = drafter.extend_context(dcache, out.taps, fb.positions, ctx_slots, unroll=unroll)
    pad = lambda x: jnp.zeros(inp.fed_anchor.shape, jnp.int32).at[:S].set(jnp.where(inp.live, x, 0).astype(jnp.int32))
    res = SpecOutputs(bs.tokens, acc.num_accepted, acc.bonus, verify_lens, acc.block_accept, survival, bs.confidence,
                      *lp, pad(acc.bonus), pad(inp.start + acc.num_accepted + 1))
    return res, out.cache, dcache, lstate


def decode_step(target, drafter, tcache: KVCache, dcache: KVCache, lstate: LogitState | None, inp: SpecInputs, *,
                num_tokens: int, page_size: int, target_options: dict, greedy: bool = False):
    """A plain decode step in a DSpark round's place: each anchor alone through the target (its
    row becomes draft context), the next token sampled as the plain engine samples it (key of
    the sampled position; processed as its processed steps process it), nothing drafted.  Same
    inputs and outputs as spec_step.  greedy: every live row has temperature 0 (the host knows),
    so the argmax alone: the sampling path sits behind device-side conditionals, one of which
    this step's GPU executable evaluated on the host, idling the device ~3.5 ms a call at the 8B
    shape (docs/decisions.md), where the plain engine's greedy step has none."""
    G, S = drafter.config.block_size, inp.anchor.shape[0]
    ones = jnp.where(inp.live, 1, 0).astype(jnp.int32)
    fb = front_pack(inp.anchor, jnp.zeros((S, G), jnp.int32), ones, inp.start, inp.page_table, inp.num_seqs,
                    num_tokens=num_tokens, page_size=page_size)
    out = target(tcache, fb, tap_layers=drafter.config.target_layer_ids, **target_options)
    token, lp, lstate = sample_processed(out.logits[:S], (inp.temperature, inp.top_k, inp.top_p, inp.seed, inp.start + 1),
                                         lstate, jnp.where(inp.live, inp.logit_slot, -1),
                                         variant="greedy" if greedy else "any")
    # logprobs of the one committed token at window row 0 (none in an unprocessed round)
    lp = empty_logprobs(S) if lp is None else TokenLogprobs(*(
        jnp.zeros((S, G + 1, *x.shape[1:]), x.dtype).at[:, 0].set(x) for x in lp))
    _, _, valid = packed_rows(ones, num_tokens)
    dcache = drafter.extend_context(dcache, out.taps, fb.positions, jnp.where(valid, fb.slot_mapping, dcache.drop_slot),
                                    unroll=not target_options["scan_layers"])
    zeros = jnp.zeros((S,), jnp.int32)
    pad = lambda x: jnp.zeros(inp.fed_anchor.shape, jnp.int32).at[:S].set(jnp.where(inp.live, x, 0).astype(jnp.int32))
    res = SpecOutputs(jnp.zeros((S, G), jnp.int32), zeros, token, ones, zeros, jnp.zeros((S, G), jnp.float32),
                      jnp.zeros((S, G), jnp.float32), *lp, pad(token), pad(inp.start + 1))
    return res, out.cache, dcache, lstate


def spec_rounds(target_def, drafter_def, target_state, drafter_state, tcache: KVCache, dcache: KVCache,
                lstate: LogitState | None, inp: SpecInputs, sts_temperatures, **options):
    """len(inp.budget) consecutive rounds; round j > 0 starts every live request from round
    j - 1's next anchor and position (on the device), so the host sees only the first round's
    inputs and all the rounds' results.  Returns (SpecOutputs with a leading [rounds] axis on
    every host field and the last round's next anchors and positions; tcache; dcache; lstate)."""
    S = inp.anchor.shape[0]
    chained = jnp.where(inp.live, jnp.arange(S, dtype=jnp.int32), -1)
    outs, step_inp = [], inp
    for j in range(inp.budget.shape[0]):
        step_inp = step_inp.replace(budget=inp.budget[j])
        out, tcache, dcache, lstate = spec_step(target_def, drafter_def, target_state, drafter_state, tcache, dcache,
                                                lstate, step_inp, sts_temperatures, **options)
        outs.append(out)
        step_inp = step_inp.replace(fed_anchor=out.next_anchor, fed_start=out.next_start, fed_index=chained)
    stacked = SpecOutputs(*(jnp.stack([getattr(o, f) for o in outs]) for f in RESULT_FIELDS),
                          outs[-1].next_anchor, outs[-1].next_start)
    return stacked, tcache, dcache, lstate


def prefill_step(target_def, drafter_def, target_state, drafter_state, tcache: KVCache, dcache: KVCache,
                 lstate: LogitState | None, batch: ForwardBatch, sampling, *, target_options: dict):
    """Target prefill with taps; the prompt rows become draft context; the first token is sampled
    (processed, with its logprobs, where the engine runs logit processors: sampling then ends
    with the rows' logit slots) -> (tokens, logprobs, tcache, dcache, lstate)."""
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state)
    out = target(tcache, batch, tap_layers=drafter.config.target_layer_ids, **target_options)
    # Padding rows (sentinel-page slots) are dropped from the draft cache's scatter, not collided.
    ctx_slots = jnp.where(batch.slot_mapping >= dcache.page_size, batch.slot_mapping, dcache.drop_slot)
    dcache = drafter.extend_context(dcache, out.taps, batch.positions, ctx_slots,
                                    unroll=not target_options["scan_layers"])
    tokens, lp, lstate = sample_processed(out.logits, sampling[:5], lstate, sampling[5] if lstate is not None else None)
    return tokens, lp, out.cache, dcache, lstate
