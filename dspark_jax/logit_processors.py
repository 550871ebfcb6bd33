"""Logit processors: penalties, logit bias and min_tokens on the target's logits, on the device.

What they do to a request's raw target logits, in vLLM v1's order:

- logit_bias: each listed id's bias is added to its logit;
- min_tokens: EOS and stop_token_ids are at -inf while fewer than min_tokens tokens are generated;
- repetition_penalty (HF / vLLM): a prompt or generated token's logit is divided by it if
  positive, multiplied by it otherwise;
- frequency_penalty / presence_penalty (OpenAI): ``logit -= frequency * count + presence * (count > 0)``,
  count over the generated tokens.

The result is the processed target distribution: greedy takes its argmax, sampling applies
temperature, top-k and top-p to it as before.  Logprobs stay raw (dspark_jax/logprobs.py).

State: one row per engine slot (LogitState: generated-token counts, prompt / stop flags, the dense
bias row, the penalties and where min_tokens ends), written once by ``install`` when a request
that uses processors is admitted (the bias travels as sparse (id, value) arrays and is scattered
on the device), read by a step through each row's slot (-1: the raw logits, untouched) and
advanced at commit by ``commit_counts``, inside the step that committed.  It is donated through
every call like the KV cache; nothing about it crosses to the host after the install.  It holds
9 bytes per slot and vocabulary id (87 MB for 64 slots of Qwen3's 151,936 ids).

Speculative rounds stay lossless because a verify window is processed row by row: row j (the
distribution of the token after window input j) sees the counts with drafts 1..j added and the
min_tokens mask of its own position, the distribution that holds if those drafts are accepted.

Cost: a batch in which no request uses processors or logprobs runs the computation it ran
before (a round's packed inputs carry one more int per row, the logit slot, which it never
reads); processed steps and rounds are separate executables ("processed" variants),
chosen on the host per batch like the greedy and sampling decode executables
(EngineConfig.logit_processors says whether they compile at start-up or on first use).  Only
prefill always processes (and computes logprobs): its few sampled rows cost nothing beside the
prompt's forward, and a first token then never needs an executable of its own.

Structured output (dspark_jax/grammar) rides on the same path: a constrained request is a
processed one whose rows are also masked by its grammar's DFA state (a window row by the state
after its earlier drafts), advanced at commit like the counts.  The grammar state joins the
LogitState (``grammar``) only in constrained steps and rounds, variants of their own (prefill's
too: CONSTRAINED), so other batches run the executables they ran before.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.grammar import dfa
from dspark_jax.grammar.pool import GrammarPool, default_pool_rows
from dspark_jax.logprobs import TokenLogprobs, empty_logprobs, token_logprobs, window_logprobs
from dspark_jax.sampling import sample
from dspark_jax.spec.common.packing import packed_rows

MAX_LOGIT_BIAS = 300  # logit_bias entries a request may set (OpenAI's limit)
MAX_STOP_IDS = 64  # EOS and stop ids a min_tokens request may mask
PROMPT, STOP = 1, 2  # LogitState.flags bits
CONSTRAINED = 2  # a step's processing level beside False / True (processed): processed and grammar-masked


class LogitState(NamedTuple):
    counts: jax.Array  # [slots, V] int32 generated-token counts
    flags: jax.Array  # [slots, V] uint8 PROMPT (a prompt token) | STOP (masked under min_tokens)
    bias: jax.Array  # [slots, V] float32 logit bias
    presence: jax.Array  # [slots] float32
    frequency: jax.Array  # [slots] float32
    repetition: jax.Array  # [slots] float32
    min_end: jax.Array  # [slots] int32 stop ids masked for tokens at positions below it (prompt length + min_tokens)
    grammar: dfa.GrammarState | None = None  # constrained steps only


def allocate_logit_state(slots: int, vocab: int) -> LogitState:
    z = lambda *shape, dt: jnp.zeros(shape, dt)
    return LogitState(z(slots, vocab, dt=jnp.int32), z(slots, vocab, dt=jnp.uint8), z(slots, vocab, dt=jnp.float32),
                      z(slots, dt=jnp.float32), z(slots, dt=jnp.float32), jnp.ones((slots,), jnp.float32),
                      z(slots, dt=jnp.int32))


class Install(NamedTuple):
    """One request's processors, as host arrays (ids padded with the vocabulary size: dropped)."""

    slot: np.ndarray  # [] int32
    prompt_ids: np.ndarray  # [max_len] int32
    bias_ids: np.ndarray  # [MAX_LOGIT_BIAS] int32
    bias_values: np.ndarray  # [MAX_LOGIT_BIAS] float32
    stop_ids: np.ndarray  # [MAX_STOP_IDS] int32
    presence: np.ndarray  # [] float32
    frequency: np.ndarray  # [] float32
    repetition: np.ndarray  # [] float32
    min_end: np.ndarray  # [] int32

    @staticmethod
    def shapes(max_len: int) -> Install:
        s, i32, f32 = jax.ShapeDtypeStruct, np.int32, np.float32
        return Install(s((), i32), s((max_len,), i32), s((MAX_LOGIT_BIAS,), i32), s((MAX_LOGIT_BIAS,), f32),
                       s((MAX_STOP_IDS,), i32), s((), f32), s((), f32), s((), f32), s((), i32))


def install_arrays(params, prompt_ids, stop_ids, slot: int, *, vocab: int, max_len: int) -> Install:
    """The Install of a request (SamplingParams params, its prompt and its stop ids: EOS included
    unless ignore_eos) for the state row ``slot``."""
    def padded(values, n, dtype, fill):
        out = np.full(n, fill, dtype)
        out[: len(values)] = values
        return out

    stop = sorted(stop_ids) if params.min_tokens else []
    if len(stop) > MAX_STOP_IDS:
        raise ValueError(f"{len(stop)} stop ids; min_tokens masks at most {MAX_STOP_IDS}")
    bias_ids, bias_values = list(params.logit_bias), list(params.logit_bias.values())
    min_end = min(len(prompt_ids) + params.min_tokens, np.iinfo(np.int32).max)
    f32, i32 = np.float32, np.int32
    return Install(i32(slot), padded(prompt_ids, max_len, i32, vocab), padded(bias_ids, MAX_LOGIT_BIAS, i32, vocab),
                   padded(bias_values, MAX_LOGIT_BIAS, f32, 0.0), padded(stop, MAX_STOP_IDS, i32, vocab),
                   f32(params.presence_penalty), f32(params.frequency_penalty), f32(params.repetition_penalty),
                   i32(min_end))


def install(state: LogitState, inst: Install) -> LogitState:
    """Reset row inst.slot to a new request's processors: counts 0, prompt and stop flags, dense bias."""
    V = state.counts.shape[1]
    on = lambda ids: jnp.zeros((V,), bool).at[ids].set(True, mode="drop")
    flags = on(inst.prompt_ids).astype(jnp.uint8) * PROMPT | on(inst.stop_ids).astype(jnp.uint8) * STOP
    bias = jnp.zeros((V,), jnp.float32).at[inst.bias_ids].add(inst.bias_values, mode="drop")
    s = inst.slot
    return LogitState(state.counts.at[s].set(0), state.flags.at[s].set(flags), state.bias.at[s].set(bias),
                      state.presence.at[s].set(inst.presence), state.frequency.at[s].set(inst.frequency),
                      state.repetition.at[s].set(inst.repetition), state.min_end.at[s].set(inst.min_end))


def _penalize(logits, count, prompt, presence, frequency, repetition):
    """Repetition, then frequency and presence penalties, elementwise (count: generated count)."""
    seen = prompt | (count > 0)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * count - presence * (count > 0)


def process(logits: jax.Array, state: LogitState, slot: jax.Array, position: jax.Array,
            prior_ids: jax.Array | None = None, prior_valid: jax.Array | None = None) -> jax.Array:
    """Processed logits [N, V] of raw logits [N, V]: row n as slot[n]'s request sees it when it
    samples the token at absolute ``position[n]``, after its counted tokens and prior_ids[n]
    (valid where prior_valid [N, G]: a verify window's earlier drafts).  Rows with slot -1 raw."""
    N, V = logits.shape
    s = jnp.clip(slot, 0, state.counts.shape[0] - 1)
    counts, flags = state.counts[s], state.flags[s]
    stopped = ((flags & STOP) != 0) & (position < state.min_end[s])[:, None]
    biased = jnp.where(stopped, -jnp.inf, logits + state.bias[s])
    pen = [x[s][:, None] for x in (state.presence, state.frequency, state.repetition)]
    out = _penalize(biased, counts.astype(jnp.float32), (flags & PROMPT) != 0, *pen)
    if prior_ids is not None:
        # The drafts' own columns: their counts grow by their occurrences among the valid drafts
        # (equal ids get equal values, so the scatter's duplicates agree).
        prior_ids = prior_ids.astype(jnp.int32)
        occurs = ((prior_ids[:, :, None] == prior_ids[:, None, :]) & prior_valid[:, None, :]).sum(-1)
        take = lambda a: jnp.take_along_axis(a, prior_ids, axis=1)
        count = (take(counts) + occurs).astype(jnp.float32)
        vals = _penalize(take(biased), count, (take(flags) & PROMPT) != 0, *pen)
        cols = jnp.where(prior_valid, prior_ids, V)
        out = out.at[jnp.arange(N)[:, None], cols].set(vals, mode="drop")
    if state.grammar is not None:
        rows = dfa.slot_rows(state.grammar, slot)
        if prior_ids is not None:
            rows = dfa.walk(state.grammar, rows, prior_ids, prior_valid)
        out = dfa.mask(out, state.grammar, rows)
    return jnp.where((slot >= 0)[:, None], out, logits)


def commit_counts(state: LogitState, slot: jax.Array, tokens: jax.Array, valid: jax.Array) -> LogitState:
    """Count committed tokens [N, W] (where valid [N, W]) into each row's slot (-1: not counted),
    and walk the slot's grammar state over them in a constrained step."""
    rows = jnp.where(valid & (slot >= 0)[:, None], slot[:, None], state.counts.shape[0])
    state = state._replace(counts=state.counts.at[rows, tokens.astype(jnp.int32)].add(1, mode="drop"))
    if state.grammar is not None:
        state = state._replace(grammar=dfa.commit(state.grammar, slot, tokens, valid))
    return state


def draft_grammar(state: LogitState | None, slot: jax.Array):
    """(GrammarState, each row's DFA row [S]) that a constrained round masks its drafter's
    proposals with (slot -1: unconstrained rows); None outside constrained rounds."""
    if state is None or state.grammar is None:
        return None
    return state.grammar, dfa.slot_rows(state.grammar, slot)


def sample_processed(logits: jax.Array, sampling: tuple, state: LogitState | None, slot: jax.Array | None, *,
                     variant: str = "any") -> tuple[jax.Array, TokenLogprobs | None, LogitState | None]:
    """One token per row as a prefill or a plain decode step samples it (sampling: the arrays of
    sampling.sample, position last): processed where the row has a slot, counted into the state,
    with its raw logprobs.  state None: the plain sampler alone -> (tokens, None, None)."""
    if state is None:
        return sample(logits, *sampling, variant=variant), None, None
    processed = process(logits, state, slot, sampling[4])
    tokens = sample(processed, *sampling, variant=variant)
    state = commit_counts(state, slot, tokens[:, None], jnp.ones((tokens.shape[0], 1), bool))
    return tokens, token_logprobs(logits, tokens), state


def commit_window(state: LogitState | None, slot: jax.Array, live: jax.Array, packed_logits: jax.Array,
                  verify_lens: jax.Array, drafts: jax.Array, num_accepted: jax.Array, bonus: jax.Array):
    """After a verified round: its committed tokens (drafts[:a] + the bonus, per request) counted
    into the state, and their raw logprobs from the packed verify logits [T, V].  state None (an
    unprocessed round) -> (zero-size logprobs, None)."""
    S, G = drafts.shape
    if state is None:
        return empty_logprobs(S), None
    j = jnp.arange(G + 1)[None, :]
    drafts_w = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    tokens = jnp.where(j < num_accepted[:, None], drafts_w, bonus[:, None]).astype(jnp.int32)
    state = commit_counts(state, jnp.where(live, slot, -1), tokens, j <= num_accepted[:, None])
    return window_logprobs(packed_logits, verify_lens, tokens), state


def process_window(packed_logits: jax.Array, state: LogitState | None, slot: jax.Array, start: jax.Array,
                   drafts: jax.Array, verify_lens: jax.Array, num_tokens: int) -> jax.Array:
    """The processed logits of a verify buffer: packed_logits [T, V] of front-packed windows
    (anchor at position start[r], then drafts [S, G]); each row processed with its window's
    earlier drafts counted (raw where state is None or on padding rows)."""
    if state is None:
        return packed_logits
    req, within, valid = packed_rows(verify_lens, num_tokens)
    prior_valid = jnp.arange(drafts.shape[1])[None, :] < within[:, None]
    return process(packed_logits, state, jnp.where(valid, slot[req], -1), start[req] + 1 + within, drafts[req],
                   prior_valid)


class LogitProcessors:
    """The engine's processor state on the device and the executable that installs a request's
    processors into it.  ``precompile``: whether workers compile their processed variants at
    start-up (else on first use, noted by the runner like every compile)."""

    def __init__(self, runner, *, slots: int, vocab: int, max_len: int, precompile: bool, grammar_rows: int = 0):
        self.runner = runner
        self.grammar = GrammarPool(runner, rows=grammar_rows or default_pool_rows(vocab), slots=slots, vocab=vocab)
        self.vocab, self.max_len, self.precompile = vocab, max_len, precompile
        self.parallel = runner.parallel
        # made where the steps run: replicated over a tensor-parallel engine's devices
        self.state = self.parallel.build(lambda: allocate_logit_state(slots, vocab))
        self._jit = jax.jit(install, donate_argnums=(0,))
        self._compiled = None

    def executables(self):
        return [("logit processors install", self._executable)]

    def _executable(self):
        if self._compiled is None:
            from dspark_jax.engine.model_runner import abstract  # (the engine package imports this module)

            inst = Install.shapes(self.max_len)
            if not self.parallel.default:  # the install arrays arrive replicated, as the state is
                inst = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.parallel.sharding()),
                                    inst)
            self._compiled = self.runner.compile(self._jit.lower(abstract(self.state), inst))
        return self._compiled

    def install(self, req) -> None:
        """Reset the request's slot row to its processors and its grammar's initial state (before
        its first token is sampled)."""
        inst = install_arrays(req.params, req.prompt_ids, req.stop_ids, req.slot, vocab=self.vocab, max_len=self.max_len)
        self.state = self._executable()(self.state, self.parallel.put(inst))
        if req.grammar_row is not None or self.grammar.state is not None:
            self.grammar.start(req.slot, -1 if req.grammar_row is None else req.grammar_row)

    def state_for(self, level) -> LogitState | None:
        """The state a step of this level takes: None (False), the processors' (True), with
        the grammar state (CONSTRAINED)."""
        if not level:
            return None
        return self.state._replace(grammar=self.grammar.state) if level == CONSTRAINED else self.state

    def keep(self, state: LogitState | None) -> None:
        """Store the state a step returned (donated: the old one is gone)."""
        if state is not None:
            if state.grammar is not None:
                self.grammar.state = state.grammar
            self.state = state._replace(grammar=None)

    @staticmethod
    def level(reqs) -> int | bool:
        """The processing level a batch needs: CONSTRAINED, True (processed) or False."""
        if any(r.grammar is not None for r in reqs):
            return CONSTRAINED
        return any(r.processed for r in reqs)

    @staticmethod
    def slots(reqs, rows: int, when=None) -> np.ndarray:
        """[rows] int32: each request's slot where it uses processors (and ``when[i]``), else -1."""
        out = np.full(rows, -1, np.int32)
        for i, r in enumerate(reqs):
            if r.params.processes_logits and (when is None or when[i]):
                out[i] = r.slot
        return out
