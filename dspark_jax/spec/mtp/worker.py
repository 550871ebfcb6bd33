"""MTPWorker: rounds of the MTP / EAGLE-style chain drafter (the baseline arm).

Draft k tokens one after another, verify anchor + k with the target, commit the accepted prefix
and the bonus (SGLang's "k-1-(k+1)", e.g. 3-1-4 for k = 3).  The drafter's one-layer cache
shares the target's page ids and every request reserves k + 1 positions past its committed
length.  Rows the target committed but the drafter has not yet read are carried on the device
per request slot between rounds (spec/mtp/step.py Pending).  Verification is always static, so
a round's executable depends only on the batch size: one per tier bs * (k + 1) of the ladder.
Rounds are synchronous: the next round's drafting needs this round's kept rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.engine.background_compile import own_or_cover
from dspark_jax.engine.model_runner import abstract
from dspark_jax.engine.request import Request
from dspark_jax.engine.worker import prefill_sampling_struct, prefill_shapes
from dspark_jax.forward_batch import shape_struct
from dspark_jax.logit_processors import CONSTRAINED
from dspark_jax.logprobs import top_width
from dspark_jax.parallel.host import to_host
from dspark_jax.spec.common.stats import commit_rounds
from dspark_jax.spec.common.tiers import TokenTiers
from dspark_jax.spec.common.worker import DraftWorker
from dspark_jax.spec.mtp.model import allocate_mtp_cache
from dspark_jax.spec.mtp.step import MTPInputs, MTPOutputs, allocate_pending, mtp_prefill_step, mtp_spec_step


@dataclasses.dataclass
class _Round:
    reqs: list[Request]
    results: jax.Array
    rows: int
    processed: int | bool = False  # ran the processed executable (its results carry logprobs)


class MTPWorker(DraftWorker):
    name = "mtp"
    overlaps = False

    def __init__(self, drafter, spec):
        super().__init__(drafter, spec)
        self.gamma = self.num_steps = k = spec.num_steps or 3
        self.lookahead = k + 1

    def kv_bytes_per_token(self, dtype) -> int:
        d = self.drafter.config
        return 2 * d.num_key_value_heads * d.head_dim * jnp.dtype(dtype).itemsize  # one layer

    def allocate_draft_cache(self, num_pages, page_size, dtype):
        d, par = self.drafter.config, self.engine.parallel
        if par.default:
            return allocate_mtp_cache(d, num_pages, page_size, dtype)
        return par.allocate_kv(1, num_pages, page_size, d.num_key_value_heads, d.head_dim, dtype)

    def bind(self, engine) -> None:
        self.drafter.config.check_target(engine.config)
        super().bind(engine)
        runner, k = engine.runner, self.num_steps
        self.tiers = TokenTiers(k, engine.decode_buckets)
        self.pending = engine.parallel.put(
            allocate_pending(engine.ec.max_running_requests, k, engine.config.hidden_size, runner.dtype))
        self._prefill_jit = self.jit_step(functools.partial(
            mtp_prefill_step, runner.graphdef, self.drafter_def, target_options=runner.forward_options(True)),
            donate=(2, 3, 4, 5), ins=("kv", "kv", None, None, None, None, None, None),
            outs=(None, None, "kv", "kv", None, None))
        self._round_jit = self.jit_step(functools.partial(
            mtp_spec_step, runner.graphdef, self.drafter_def, page_size=engine.pool.page_size,
            target_options=runner.forward_options(False)),
            donate=(2, 3, 4, 5), packed_input=6, packed_output=True, static=("num_tokens",),
            ins=("kv", "kv", None, None, None, None), outs=(None, None, "kv", "kv", None, None))
        self.new_stats()

    # -- compilation ---------------------------------------------------------------------------
    def _round_shape(self, batch_size: int) -> tuple[int, int]:
        """(tokens, request rows) of a round: the tier bs * (k + 1) of the ladder bucket."""
        T = self.tiers.round_up(batch_size * (self.num_steps + 1))
        return T, T // (self.num_steps + 1)

    def widest(self, processed: bool) -> list[tuple]:
        return [self._widest_round(True)] if processed else [self.widest_prefill(), self._widest_round(False)]

    def _widest_round(self, processed: int | bool) -> tuple:
        """The key of the widest round: the most tokens, rows and pages compiled."""
        e = self.engine
        return ("round", *self._round_shape(max(e.decode_buckets)), max(e.page_widths), processed)

    def keys(self):
        e = self.engine
        rounds = [("round", *self._round_shape(b), P, processed) for b in e.decode_buckets
                  for P in e.page_widths for processed in self.processed_variants()]
        return rounds[::-1] + [("prefill", T, S, True) for T, S in prefill_shapes(e)][::-1]

    def describe(self, key):
        if key[0] == "prefill":
            return f"mtp prefill tokens={key[1]} seqs={key[2]}"
        T, S, P, processed = key[1:]
        return f"mtp round tokens={T} rows={S} pages={P}{' processed' if processed else ''}"

    def _caches(self):
        return self.engine.runner.cache, self.dcache, self.pending

    def _prefill_executable(self, T: int, S: int, level: int | bool = True):
        e = self.engine
        lower = lambda: self._prefill_jit.lower(
            abstract(e.runner.state), abstract(self.drafter_state), *abstract(self._caches()),
            abstract(self.lstate(level)), shape_struct(T, S, e.pages_per_seq, S), prefill_sampling_struct(e, S),
            jax.ShapeDtypeStruct((T,), np.int32),
            jax.ShapeDtypeStruct((S,), np.int32))
        return self.executable(("prefill", T, S, level), lower, optional=level == CONSTRAINED)

    def _inputs_pack(self, S: int, P: int):
        return self.pack(("inputs", S, P), lambda: MTPInputs.shapes(S, P))

    def _results_pack(self, S: int, processed: int | bool = False):
        top = top_width(self.engine.config.vocab_size) if processed else 0
        return self.pack(("results", S, bool(processed)), lambda: MTPOutputs.result_shapes(S, self.num_steps, top))

    def _round_executable(self, T: int, S: int, P: int, processed: int | bool = False):
        """processed: the variant with logit processors and logprobs (dspark_jax/logit_processors.py);
        CONSTRAINED: with grammar masks too."""
        e = self.engine
        pack = self._inputs_pack(S, P)
        lower = lambda: self._round_jit.lower(
            abstract(e.runner.state), abstract(self.drafter_state), *abstract(self._caches()),
            abstract(self.lstate(processed)), pack.spec(), (), num_tokens=T, pack=pack,
            out_pack=self._results_pack(S, processed))
        return self.executable(("round", T, S, P, processed), lower, optional=bool(processed))

    # -- steps ---------------------------------------------------------------------------------
    def prefill(self, chunks):
        batch, samp, level, fn = self.prefill_inputs(chunks)
        T, S = batch.input_ids.shape[0], batch.page_table.shape[0]
        next_ids = np.zeros(T, np.int32)  # the prompt token after each row (the sampled one is filled in on device)
        final_slot = np.full(S, -1, np.int32)
        t = 0
        for i, (r, n) in enumerate(chunks):
            nxt = r.prompt_ids[r.num_cached + 1: r.num_cached + n + 1]
            next_ids[t: t + len(nxt)] = nxt
            if r.num_cached + n == len(r.prompt_ids):
                final_slot[i] = r.slot
            t += n
        runner = self.engine.runner
        tokens, lp, runner.cache, self.dcache, self.pending, lstate = fn(
            runner.state, self.drafter_state, *self._caches(), self.lstate(level), batch, samp, next_ids, final_slot)
        self.keep_lstate(lstate)
        return tokens, lp

    def dispatch(self, reqs, prev):
        bs = len(reqs)
        T, S = self._round_shape(bs)
        a = self.batch_arrays(reqs, S)
        P = a.table.shape[1]
        (_, T, S, P, _), fn = own_or_cover(self._compiled, ("round", T, S, P, a.processed), self.step_executable,
                                           dims=(1, 2, 3),
                                           widest=self._widest_round(a.processed) if self.pads(a.processed) else None)
        if a.table.shape != (S, P):  # padded onto a wider shape while its own compiles
            a = self.batch_arrays(reqs, S, pages=P)
        column = lambda values: np.concatenate([np.asarray(values, np.int32), np.zeros(S - bs, np.int32)])
        inp = MTPInputs(anchor=column([r.output_ids[-1] for r in reqs]), start=column([r.total_len - 1 for r in reqs]),
                        page_table=a.table, live=a.live, num_seqs=np.int32(bs), slot=column([r.slot for r in reqs]),
                        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                        logit_slot=a.logit_slot)
        runner = self.engine.runner
        results, _, runner.cache, self.dcache, self.pending, lstate = fn(
            runner.state, self.drafter_state, *self._caches(), self.lstate(a.processed),
            self._inputs_pack(S, P).pack(inp), ())
        self.keep_lstate(lstate)
        return _Round(reqs, results, S, a.processed)

    def read(self, rnd: _Round):
        out = self._results_pack(rnd.rows, rnd.processed).unpack_host(to_host(rnd.results))
        self.stats["rounds"] += 1
        done = commit_rounds(self.stats, rnd.reqs, out.drafts, out.num_accepted, out.bonus, out.verify_lens,
                             out.block_accept, out.logprobs if rnd.processed else None)
        return [(r, committed) for r, _, committed in done]

    def summary(self) -> dict:
        return {**super().summary(), "num_steps": self.num_steps}

