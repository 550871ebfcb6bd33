"""The speculative decoding steps as pure functions over explicit state (jitted by the runner).

prefill_step: the target prefills prompt chunks with its tapped layers, the drafter's context
cache is extended with those rows, and the first token is sampled.

spec_step, one round for a packed batch of requests:
  draft a block per request (drafter + sequential head + confidence)
  -> verify windows (static: the full block; compact / cap-accept: top-K over current survival,
     K chosen on the host from lagged survival)
  -> front-pack the windows into the tier buffer -> target verify (ragged paged attention)
  -> accept (exact match / speculative sampling) -> extend the draft context cache with the
     target's tapped hidden states of the anchor and accepted drafts.
Only the committed tokens (drafts[:a] + bonus) and small per-request statistics go back to
the host.

Both steps take the target's execution options as ``target_options`` (a hashable tuple of
(name, value) pairs for the target forward: ``scan_layers``, ``norm_backend``,
``kv_write_backend``) and ``unroll`` for the drafter's loops.  On the GPU the engine unrolls
every loop, as the plain engine's decode step does: an XLA while loop there is driven from the
host one iteration at a time, and a speculative round runs several (target layers, drafter
layers, the gamma sampling steps, the context extension).  Prefill keeps its scans.

Random keys are derived per request from (seed, anchor position), so outputs do not depend on
batch composition.

Overlap: a round also returns each request's next anchor and position (padded to the engine's
slot count R, so every tier's executable shares one shape), and takes the previous round's as
`fed_anchor` / `fed_start`: row i of this round reads row `fed_index[i]` of them, or the host's
anchor / start where `fed_index[i]` is -1 (a request the previous round did not hold).  The
engine dispatches round t+1 on those device arrays before it reads round t, so the host never
waits between rounds, also when requests left the batch in between.

spec_rounds: several rounds in one executable (SpeculativeConfig.rounds_per_call), each fed
by the previous one on the device, their results stacked.  With the embedded pair a round's
device time (0.6-1.1 ms at batch 64 on the H200) is below the host's work per round (the
executable's dispatch alone 0.55-0.8 ms, then reading and committing), so the serving loop ran
at the host's pace; n rounds per dispatch split that work n ways
(benchmarks/results/round_profile_gpu_bs64_b346cf1.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.spec.dspark.model import sample_block
from dspark_jax.forward_batch import ForwardBatch
from dspark_jax.kv_cache import KVCache
from dspark_jax.sampling import sample
from dspark_jax.spec.common.acceptance import target_probs, verify
from dspark_jax.spec.common.packing import front_pack, packed_rows, topk_verify_lens, unpack_rows

MODES = ("static", "compact", "cap-accept")


class SpecInputs(NamedTuple):
    anchor: jax.Array  # [S] int32 last committed token (not yet in the target cache)
    start: jax.Array  # [S] int32 its absolute position
    page_table: jax.Array  # [S, P]
    live: jax.Array  # [S] bool
    num_seqs: jax.Array  # [] int32
    budget: jax.Array  # [] int32 extra verify tokens (compact / cap-accept); [n] for spec_rounds, one a round
    temperature: jax.Array  # [S]
    top_k: jax.Array  # [S]
    top_p: jax.Array  # [S]
    seed: jax.Array  # [S] uint32
    fed_anchor: jax.Array  # [R] int32 the previous round's next_anchor
    fed_start: jax.Array  # [R] int32 the previous round's next_start
    fed_index: jax.Array  # [S] int32 row of the previous round feeding each row; -1: anchor / start
    probes: jax.Array  # [S, gamma+1, P] int32 block-accept estimator probe tokens (-1: none; P = 0 when off)


class SpecOutputs(NamedTuple):
    drafts: jax.Array  # [S, gamma]
    num_accepted: jax.Array  # [S] drafts committed
    bonus: jax.Array  # [S]
    verify_lens: jax.Array  # [S] window verified (anchor included)
    block_accept: jax.Array  # [S] drafts full verification would accept (exact in static/cap-accept)
    survival: jax.Array  # [S, gamma] calibrated cumulative survival (for the lag ring and metrics)
    confidence_logits: jax.Array  # [S, gamma] raw z (STS data collection)
    next_anchor: jax.Array  # [R] the bonus token: the next round's anchor (0 past the live rows)
    next_start: jax.Array  # [R] its position: start + accepted + 1
    estimate: "EstimatorLogProbs | None"  # block-accept estimator inputs (compact mode, when enabled)


# The per-round results the host reads; the rest of SpecOutputs feeds the next round on the device.
ROUND_RESULT_FIELDS = SpecOutputs._fields[:7]


class EstimatorLogProbs(NamedTuple):
    """What the host-side block-accept estimator needs from a round (spec/dspark/block_accept.py),
    all under the tempered (temperature-scaled) distributions."""
    draft_logq: jax.Array  # [S, gamma] log q of each draft under the corrected draft distribution
    next_draft_logp: jax.Array  # [S] target log p of d_{w+1} at the last verified row (NaN if w == gamma)
    probe_logp: jax.Array  # [S, gamma+1, P] target log p of the probe tokens, row by row


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


def estimator_log_probs(draft_logits, drafts, target_logits, verify_lens, probes, temperature,
                        draft_temperature=None) -> EstimatorLogProbs:
    """Gather the block-accept estimator's log-probabilities on device (V never leaves it);
    draft_temperature: what the drafts were sampled at (default: the target's temperature)."""
    t = jnp.maximum(temperature, 1e-6)[:, None, None]
    t_draft = t if draft_temperature is None else jnp.maximum(draft_temperature, 1e-6)[:, None, None]
    logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32) / t_draft, axis=-1)
    draft_logq = jnp.take_along_axis(logq, drafts[..., None], axis=-1)[..., 0]
    logp = jax.nn.log_softmax(target_logits.astype(jnp.float32) / t, axis=-1)  # [S, G+1, V]
    G = drafts.shape[1]
    w = jnp.clip(verify_lens - 1, 0, G)  # verified drafts; row w scores position start + w + 1
    nxt = jnp.take_along_axis(drafts, jnp.minimum(w, G - 1)[:, None], axis=1)[:, 0]
    row_w = jnp.take_along_axis(logp, w[:, None, None], axis=1)[:, 0]  # [S, V]
    next_logp = jnp.where(w < G, jnp.take_along_axis(row_w, nxt[:, None], axis=1)[:, 0], jnp.nan)
    probe_logp = jnp.take_along_axis(logp, jnp.maximum(probes, 0), axis=-1)
    return EstimatorLogProbs(draft_logq, next_logp, jnp.where(probes >= 0, probe_logp, jnp.nan))


def spec_step(target_def, drafter_def, target_state, drafter_state, tcache: KVCache, dcache: KVCache,
              inp: SpecInputs, sts_temperatures, *, mode: str, num_tokens: int, page_size: int, backend: str,
              target_options: tuple = (), unroll: bool = False, draft_temperature_scale: float = 1.0,
              greedy: bool = False):
    """draft_temperature_scale c: drafts are sampled at c x the request's temperature (q then
    uses the same in the accept ratio, so the output distribution stays the target's; greedy
    rows are unaffected).  greedy (static): every live request has temperature 0; drafting and
    acceptance skip their sampling work (the vocabulary sort of every verified row above all)."""
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state)
    cfg = drafter.config
    G, S = cfg.block_size, inp.anchor.shape[0]
    draft_temperature = inp.temperature * draft_temperature_scale
    fed, row = inp.fed_index >= 0, jnp.maximum(inp.fed_index, 0)
    inp = inp._replace(anchor=jnp.where(fed, inp.fed_anchor[row], inp.anchor),
                       start=jnp.where(fed, inp.fed_start[row], inp.start))

    # 1. Draft.
    blk = block_batch(inp, G, cfg.mask_token_id, page_size, dcache.drop_slot)
    h, base, dcache = drafter.draft_block(target, dcache, blk, backend=backend, unroll=unroll)
    bs = sample_block(drafter, h.reshape(S, G, -1), base.reshape(S, G, -1), inp.anchor, draft_temperature,
                      _keys(inp.seed, inp.start, 1), unroll=unroll, greedy=greedy)
    survival = jnp.cumprod(jax.nn.sigmoid(bs.confidence / sts_temperatures[None, :]), axis=1)

    # 2. Windows: static verifies everything; compact / cap-accept take the top-K.
    full = jnp.where(inp.live, G + 1, 0).astype(jnp.int32)
    window = topk_verify_lens(survival, inp.budget, inp.live)
    verify_lens = window if mode == "compact" else full

    # 3. Target verify over the front-packed windows, tapping the drafter's layers.
    fb = front_pack(inp.anchor, bs.tokens, verify_lens, inp.start, inp.page_table, inp.num_seqs,
                    num_tokens=num_tokens, page_size=page_size)
    out = target(tcache, fb, tap_layers=cfg.target_layer_ids, backend=backend, **dict(target_options))
    logits = unpack_rows(out.logits, verify_lens, G + 1)
    req, within, valid = packed_rows(verify_lens, num_tokens)

    # 4. Accept.  The target's filtered distribution is computed on the packed rows (its
    # vocabulary sort then costs what the tier verifies, not the full block of every request).
    probs = None if greedy else unpack_rows(
        target_probs(out.logits, inp.temperature[req], inp.top_k[req], inp.top_p[req]), verify_lens, G + 1)
    acc = verify(logits, bs.tokens, bs.logits, jnp.maximum(verify_lens, 1), inp.temperature, inp.top_k, inp.top_p,
                 _keys(inp.seed, inp.start, 2), commit_cap=window if mode == "cap-accept" else None,
                 draft_temperature=draft_temperature, greedy=greedy, probs=probs)

    # 5. Rows anchor..a of each request become draft context (their target hidden states).
    keep = valid & (within <= acc.num_accepted[req])
    ctx_slots = jnp.where(keep, fb.slot_mapping, dcache.drop_slot)  # rejected and padding rows: not written
    dcache = drafter.extend_context(dcache, out.taps, fb.positions, ctx_slots, unroll=unroll)
    pad = lambda x: jnp.zeros(inp.fed_anchor.shape, jnp.int32).at[:S].set(jnp.where(inp.live, x, 0).astype(jnp.int32))
    est = (estimator_log_probs(bs.logits, bs.tokens, logits, verify_lens, inp.probes, inp.temperature,
                               draft_temperature)
           if inp.probes.shape[-1] else None)
    res = SpecOutputs(bs.tokens, acc.num_accepted, acc.bonus, verify_lens, acc.block_accept, survival, bs.confidence,
                      pad(acc.bonus), pad(inp.start + acc.num_accepted + 1), est)
    return res, out.cache, dcache


def spec_rounds(target_def, drafter_def, target_state, drafter_state, tcache: KVCache, dcache: KVCache,
                inp: SpecInputs, sts_temperatures, *, rounds: int, **options):
    """``rounds`` consecutive spec_step rounds: inp.budget [rounds] holds each round's budget;
    round j > 0 starts every live request from round j - 1's next anchor and position (on the
    device), so the host sees only the first round's inputs and all the rounds' results.
    Returns (SpecOutputs with a leading [rounds] axis on every host field, the last round's
    next anchors and positions, no estimator inputs; tcache; dcache)."""
    S = inp.anchor.shape[0]
    chained = jnp.where(inp.live, jnp.arange(S, dtype=jnp.int32), -1)
    outs, step_inp = [], inp
    for j in range(rounds):
        step_inp = step_inp._replace(budget=inp.budget[j])
        out, tcache, dcache = spec_step(target_def, drafter_def, target_state, drafter_state, tcache, dcache,
                                        step_inp, sts_temperatures, **options)
        outs.append(out)
        step_inp = step_inp._replace(fed_anchor=out.next_anchor, fed_start=out.next_start, fed_index=chained)
    last = outs[-1]
    stacked = SpecOutputs(*(jnp.stack([getattr(o, f) for o in outs]) for f in ROUND_RESULT_FIELDS),
                          last.next_anchor, last.next_start, last.estimate if rounds == 1 else None)
    return stacked, tcache, dcache


def prefill_step(target_def, drafter_def, target_state, drafter_state, tcache: KVCache, dcache: KVCache,
                 batch: ForwardBatch, sampling, *, backend: str, target_options: tuple = (), unroll: bool = False,
                 sample_variant: str = "any"):
    """Target prefill with taps; the prompt rows become draft context; the first token is sampled
    (sample_variant: sampling.sample's; "stochastic" draws the same tokens without its
    device-side conditional)."""
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state)
    out = target(tcache, batch, tap_layers=drafter.config.target_layer_ids, backend=backend, **dict(target_options))
    # Padding rows (sentinel-page slots) are dropped from the draft cache's scatter, not collided.
    ctx_slots = jnp.where(batch.slot_mapping >= dcache.page_size, batch.slot_mapping, dcache.drop_slot)
    dcache = drafter.extend_context(dcache, out.taps, batch.positions, ctx_slots, unroll=unroll)
    return sample(out.logits, *sampling, variant=sample_variant), out.cache, dcache


def join_feed(fed_anchor, fed_start, first_tokens, joins):
    """The feed of a round that also starts requests a prefill has just completed, on the device:
    fed_anchor / fed_start [R] (the in-flight round's next anchors and positions), the prefill's
    sampled tokens [S_p], joins [3, S_p] int32 host rows (destination row in the feed, R or more
    for none; the prefill row holding its first token; that token's position)."""
    dst, src, start = joins
    return (fed_anchor.at[dst].set(first_tokens[src].astype(fed_anchor.dtype), mode="drop"),
            fed_start.at[dst].set(start, mode="drop"))
