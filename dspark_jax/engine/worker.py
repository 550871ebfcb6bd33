"""The decoding algorithm behind the engine's loop, and the plain one.

The engine owns requests, admission, KV pages, slots and the loop; a worker owns the compiled
steps of one algorithm (plain decoding, DSpark, MTP) and what they need besides the target
(a drafter, its cache).  The protocol is small: compile, prefill prompt chunks, dispatch a
decode step or speculative round, read it back and commit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from dspark_jax.engine.background_compile import own_or_cover
from dspark_jax.engine.flat_state import with_flat_states
from dspark_jax.engine.model_runner import abstract, round_up
from dspark_jax.engine.request import Request, Status
from dspark_jax.forward_batch import ForwardBatch, build_forward_batch, decode_forward_batch, shape_struct
from dspark_jax.logit_processors import CONSTRAINED, LogitProcessors, sample_processed
from dspark_jax.logprobs import TokenLogprobs
from dspark_jax.parallel.host import prefetch, to_host
from dspark_jax.sampling import sampling_arrays, sampling_struct

log = logging.getLogger(__name__)


class BatchArrays(NamedTuple):
    """A step's per-request host arrays that last as long as its batch (Worker.batch_arrays)."""

    live: np.ndarray  # [S] bool
    table: np.ndarray  # [S, P] int32 page tables
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray
    logit_slot: np.ndarray  # [S] int32 logit-processor rows, -1: none
    # some request uses logit processors or logprobs (True; CONSTRAINED: a grammar): the step runs
    # a processed (constrained) executable
    processed: int | bool


class Worker:
    """What the engine asks of an algorithm.  ``bind`` runs once the engine's pool and target
    cache exist; ``lookahead`` (positions past a request's last token that one call may write)
    is reserved with every request's KV pages."""

    name = "none"
    lookahead = 0
    overlaps = True  # dispatch step t+1, fed on the device, before step t is read
    stats: dict | None = None  # round statistics (speculative workers)

    def kv_bytes_per_token(self, dtype) -> int:
        """KV bytes per token the worker keeps beside the target's (a drafter's cache, sharing
        the target's page ids)."""
        return 0

    def bind(self, engine) -> None:
        self.engine = engine
        self._last_arrays = None  # batch_arrays' last (key, arrays)

    def batch_arrays(self, reqs, S: int, pages: int | None = None) -> BatchArrays:
        """Host arrays of a step for reqs padded to S rows: live mask, page tables (as wide as
        the step's context bucket, or ``pages``), sampling parameters and logit-processor rows.
        A serving batch keeps its requests for many steps: the last batch's arrays are reused
        (read-only), so a step rebuilds only what moves (positions, fed tokens)."""
        e = self.engine
        bs = len(reqs)
        P = pages or e.page_width(max((r.total_len for r in reqs), default=0) + self.lookahead)
        key = (S, P, tuple(reqs))  # the request objects themselves: ids may be reused once one ends
        if self._last_arrays is not None and self._last_arrays[0] == key:
            return self._last_arrays[1]
        live = np.zeros(S, bool)
        live[:bs] = True
        table = np.zeros((S, P), np.int32)
        for i, r in enumerate(reqs):
            if r.page_row is None:  # reserved at admission: the row never changes while it runs
                r.page_row = e.pool.page_table_row(r.id, e.pages_per_seq)
            table[i] = r.page_row[:P]
        temp, top_k, top_p, seed, _ = sampling_arrays([r.params for r in reqs], [r.seed for r in reqs], [0] * bs, S)
        arrays = BatchArrays(live, table, temp, top_k, top_p, seed, LogitProcessors.slots(reqs, S),
                             LogitProcessors.level(reqs))
        for a in arrays[:-1]:
            a.flags.writeable = False
        self._last_arrays = (key, arrays)
        return arrays

    def keys(self) -> list[tuple]:
        """The key of every executable the worker runs, compiled at start-up: the costliest
        compiles first, so a start-up's pool of compile threads ends on short ones (its
        background queue takes them the other way round, narrowest first)."""
        return []

    def sampled_only(self, key: tuple) -> bool:
        """Whether only a batch that samples runs key's executable (a greedy profile never does)."""
        return False

    def describe(self, key: tuple) -> str:
        """An executable's key for people (start-up progress, logs)."""
        return " ".join(map(str, key))

    def executables(self, keys: list[tuple] | None = None) -> list[tuple[str, Callable[[], object]]]:
        """(label, compile thunk) of every executable the worker runs (or of these keys)."""
        return [(self.describe(key), functools.partial(self.step_executable, key))
                for key in (self.keys() if keys is None else keys)]

    def widest(self, processed: bool) -> list[tuple]:
        """The keys of the widest step (most tokens, rows and pages) of every kind the worker runs
        with or without logit processors, the latter with prefill's: shapes any batch of that
        kind can run padded on."""
        return []

    def step_executable(self, key: tuple):
        """The executable of a step's key, as widest names it (ExecutablePending while it
        compiles in the background)."""
        raise NotImplementedError

    def warm_processed(self) -> None:
        """At start-up, once the executables are compiled: queue the widest processed steps on
        the background compile thread (where processed steps compile there)."""
        if self.pads(True):
            queued = self.engine.background.queue(build for _, build in self.executables(self.widest(processed=True)))
            if queued:
                log.info("%d widest processed steps compile in the background", queued)

    def pads(self, processed: int | bool) -> bool:
        """Whether a step at this processing level asks for its kind's widest shape first, to run
        padded on it while its own compiles: where processed steps compile in the background."""
        e = self.engine
        return bool(processed) and e.background is not None and e.processors is not None

    def calibrate(self, cached_only: bool = False) -> None:
        """Runs once the executables are compiled (e.g. to profile this device's step costs);
        cached_only: before compiling, with only what an earlier start-up cached."""

    def prefill(self, chunks: list[tuple[Request, int]]) -> tuple[jax.Array, TokenLogprobs | None]:
        """Dispatch a prefill of prompt chunks; returns each chunk's sampled next token and, where
        the engine runs logit processors, its raw logprobs (device arrays)."""
        raise NotImplementedError

    def dispatch(self, reqs: list[Request], prev):
        """Dispatch a step for reqs; prev: the unread step in flight (feeds this one on the
        device), or None."""
        raise NotImplementedError

    def feeds(self, prev, reqs: list[Request]) -> bool:
        """Whether a step for reqs can be fed on the device by the unread step prev."""
        return False

    def read(self, inflight) -> list[tuple[Request, list[int]]]:
        """Read a dispatched step back (the one host sync) and commit it: (request, new ids)."""
        raise NotImplementedError

    def release(self, req: Request) -> None:
        """A request left the engine (finished or aborted)."""

    def release_device_memory(self) -> None:
        """The engine stops using this worker: drop what it holds on the device."""

    def summary(self) -> dict:
        return {}


def prefill_tokens(engine, chunks) -> int:
    """The token bucket of a prefill of prompt chunks [(request, n)]."""
    return round_up(sum(n for _, n in chunks), engine.prefill_buckets)


def prefill_batch(engine, chunks, tokens: int | None = None) -> tuple[ForwardBatch, tuple]:
    """The packed prefill step of prompt chunks [(request, n)] and its sampling arrays, padded
    to the engine's prefill bucket (or to ``tokens``, a wider one): every worker prefills the
    same way.  Where the engine runs logit processors, the sampling arrays end with each row's
    logit slot (-1 unless the chunk completes a prompt whose request uses processors): prefill
    always processes."""
    T = tokens or prefill_tokens(engine, chunks)
    S = engine.prefill_seqs
    pool = engine.pool
    seqs = [(r.prompt_ids[r.num_cached: r.num_cached + n], r.num_cached, pool.pages(r.id)) for r, n in chunks]
    batch = build_forward_batch(seqs, page_size=pool.page_size, num_tokens=T, num_seqs=S,
                                pages_per_seq=engine.pages_per_seq)
    reqs = [r for r, _ in chunks]
    sampling = sampling_arrays([r.params for r in reqs], [r.seed for r in reqs], [len(r.prompt_ids) for r in reqs], S)
    if engine.processors is not None:
        sampling += (LogitProcessors.slots(reqs, S, [r.num_cached + n == len(r.prompt_ids) for r, n in chunks]),)
    return batch, sampling


def prefill_level(chunks) -> int:
    """The processing level of a prefill (which always processes): CONSTRAINED where a chunk
    completes the prompt of a request with a grammar, else True."""
    done = (r for r, n in chunks if r.num_cached + n == len(r.prompt_ids))
    return CONSTRAINED if any(r.grammar is not None for r in done) else True


def prefill_shapes(engine) -> list[tuple[int, int]]:
    """(tokens, sequences) of every prefill executable."""
    return [(t, engine.prefill_seqs) for t in engine.prefill_buckets]


def prefill_sampling_struct(engine, rows: int) -> tuple:
    """Abstract sampling arrays of a prefill step (prefill_batch's), and of a processed step."""
    return sampling_struct(rows) + ((jax.ShapeDtypeStruct((rows,), np.int32),) if engine.processors else ())


def logprob_rows(lp: TokenLogprobs | None, i: int, n: int = 1) -> TokenLogprobs | None:
    """Rows i..i+n of host logprobs (None stays None)."""
    return None if lp is None else TokenLogprobs(*(x[i: i + n] for x in lp))


@dataclasses.dataclass
class _DecodeStep:
    reqs: list[Request]
    tokens: jax.Array
    logprobs: TokenLogprobs | None = None


class PlainWorker(Worker):
    """One token per request per step.  Decode steps compile per bucket for all-greedy batches
    (argmax only), batches that sample, and batches holding a request with logit processors or
    logprobs ("processed": dspark_jax/logit_processors.py) or a grammar ("constrained"; prefill:
    "any-constrained"), picked on the host."""

    def bind(self, engine) -> None:
        super().bind(engine)
        runner = engine.runner
        self._compiled: dict = {}

        def step(state, cache, lstate, batch: ForwardBatch, sampling, *, prefill: bool, variant: str):
            """lstate: the logit-processor state (prefill, "processed", "constrained"; else None),
            whose rows sampling[5] names."""
            model = nnx.merge(runner.graphdef, state)
            out = model(cache, batch, **runner.forward_options(prefill))
            tokens, lp, lstate = sample_processed(out.logits, sampling[:5], lstate, sampling[5] if lstate is not None else None,
                                                  variant=variant if variant in ("greedy", "stochastic") else "any")
            return tokens, lp, out.cache, lstate

        # Per shard under tensor parallelism (the parameters, the cache by KV heads, the rest
        # replicated); the step itself when the engine has one device.
        shard = functools.partial(engine.parallel.shard_step, ins=("target", "kv", None, None, None),
                                  outs=(None, None, "kv", None))
        self._jit = {(prefill, variant): jax.jit(shard(with_flat_states(
            functools.partial(step, prefill=prefill, variant=variant), (runner.state_def,))), donate_argnums=(1, 2))
            for prefill, variant in ((True, "any"), (True, "any-constrained"), (False, "greedy"), (False, "stochastic"),
                                     (False, "processed"), (False, "constrained"))}

    def keys(self):
        e = self.engine
        variants = ("greedy", "stochastic") + (("processed",) if e.processors and e.processors.precompile else ())
        decode = [(b, b, p, v) for b in e.decode_buckets for p in e.page_widths for v in variants]
        prefill = [(t, s, e.pages_per_seq, "any") for t, s in prefill_shapes(e)]
        return decode[::-1] + prefill[::-1]  # unrolled layers compile longer than prefill's scan

    def describe(self, key):
        T, S, P, v = key
        return f"{'prefill' if v.startswith('any') else 'decode'} tokens={T} seqs={S} pages={P} {v}"

    def _lstate(self, variant: str):
        """The logit-processor state a step of this variant takes (None: it takes none)."""
        processors = self.engine.processors
        if processors is None or variant in ("greedy", "stochastic"):
            return None
        return processors.state_for(CONSTRAINED if variant.endswith("constrained") else True)

    def _executable(self, T: int, S: int, P: int, variant: str):
        def lower():  # only on a miss: _executable runs on every step
            runner, lstate = self.engine.runner, self._lstate(variant)
            samp = prefill_sampling_struct(self.engine, S) if lstate is not None else sampling_struct(S)
            return self._jit[variant.startswith("any"), variant].lower(
                abstract(runner.state), abstract(runner.cache), abstract(lstate), shape_struct(T, S, P, S), samp)

        return self.engine.compiled(self._compiled, (T, S, P, variant), lower,
                                    optional=variant in ("processed", "constrained", "any-constrained"))

    def run(self, batch: ForwardBatch, sampling, variant: str, fn=None):
        """Dispatch one step on a packed batch (variant: "any" or "any-constrained" for prefill,
        "greedy", "stochastic", "processed" or "constrained" for decode; the last three sample
        the same way, the processed ones with logit processors, whose slot column ends their
        sampling arrays).  Returns its sampled tokens, not yet read; all but "greedy" and
        "stochastic" also their logprobs: (tokens, TokenLogprobs or None).  fn: the batch's
        executable, where the caller has it already."""
        runner = self.engine.runner
        if fn is None:
            S, P = batch.page_table.shape
            fn = self._executable(batch.input_ids.shape[0], S, P, variant)
        lstate = self._lstate(variant)
        tokens, lp, runner.cache, lstate = fn(runner.state, runner.cache, lstate, batch, sampling)
        if lstate is not None:
            self.engine.processors.keep(lstate)
        return tokens if variant in ("greedy", "stochastic") else (tokens, lp)

    def prefill(self, chunks):
        e = self.engine
        variant = "any" if prefill_level(chunks) is True else "any-constrained"
        (T, _, _, _), fn = own_or_cover(self._compiled, (prefill_tokens(e, chunks), e.prefill_seqs, e.pages_per_seq,
                                                         variant), self.step_executable, dims=(0,), widest=None)
        return self.run(*prefill_batch(e, chunks, T), variant, fn)

    def feeds(self, prev, reqs):
        """The same batch at its own width (a step padded onto a wider shape feeds nothing)."""
        return prev.reqs == reqs and prev.tokens.shape[0] == round_up(len(reqs), self.engine.decode_buckets)

    def widest(self, processed: bool) -> list[tuple]:
        if processed:
            return [self._widest("processed")]
        e = self.engine
        return [(max(e.prefill_buckets), e.prefill_seqs, e.pages_per_seq, "any"), self._widest("greedy"),
                self._widest("stochastic")]

    def step_executable(self, key: tuple):
        return self._executable(*key)

    def _widest(self, variant: str) -> tuple:
        e = self.engine
        return max(e.decode_buckets), max(e.decode_buckets), max(e.page_widths), variant

    def dispatch(self, reqs, prev):
        """prev: the in-flight step for the same batch, whose device tokens (one ahead of the
        host) feed this one."""
        e = self.engine
        n, ahead = len(reqs), 0 if prev is None else 1
        lens = np.fromiter((r.total_len for r in reqs), np.int32, n)  # tokens the host has per request
        B = round_up(n, e.decode_buckets)
        arrays = self.batch_arrays(reqs, B, e.page_width(int(lens.max()) + ahead))
        level = arrays.processed
        variant = ("constrained" if level == CONSTRAINED else "processed") if level else (
            "stochastic" if arrays.temperature.any() else "greedy")
        # while its own shape compiles in the background, a wider one (if not fed)
        (B, _, P, _), fn = own_or_cover(self._compiled, (B, B, arrays.table.shape[1], variant), self.step_executable,
                                        dims=(2,) if prev is not None else (0, 1, 2),
                                        widest=self._widest(variant) if self.pads(level) else None)
        if arrays.table.shape != (B, P):
            arrays = self.batch_arrays(reqs, B, P)
        batch = decode_forward_batch(arrays.table, lens - 1 + ahead,
                                     None if prev is not None else [r.output_ids[-1] for r in reqs],
                                     page_size=e.pool.page_size)
        if prev is not None:
            batch = batch._replace(input_ids=prev.tokens)
        position = np.zeros(B, np.int32)  # of the token each row samples
        position[:n] = lens + ahead
        sampling = (arrays.temperature, arrays.top_k, arrays.top_p, arrays.seed, position)
        if level:
            tokens, lp = self.run(batch, sampling + (arrays.logit_slot,), variant, fn)
            for x in lp:
                prefetch(x)
        else:
            tokens, lp = self.run(batch, sampling, variant, fn), None
        prefetch(tokens)
        return _DecodeStep(reqs, tokens, lp)

    def read(self, step):
        tokens = to_host(step.tokens).tolist()
        lp = jax.tree.map(to_host, step.logprobs) if step.logprobs is not None else None
        return [(r, r.commit(tokens[i: i + 1], logprob_rows(lp, i))) for i, r in enumerate(step.reqs)
                if r.status is not Status.FINISHED]
