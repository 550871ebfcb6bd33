"""DSparkWorker: DSpark rounds in static, compact or cap-accept mode, overlapped.

The drafter's context cache shares the target's page tables: a context row lives at its own
position.  Each call is one executable chosen by its token tier, a function of host scalars
only (spec/dspark/planner.py), compiled ahead of time like the plain buckets.  A compact or
cap-accept worker that can never trim (no cost table, or one flat in K) runs static rounds,
which commit what a full window would.

Overlap: call t+1 is dispatched before call t is read, fed on the device by call t's next
anchors and positions (row by row: a request call t did not hold starts from the host's
committed state).  Everything call t+1 needs from the host is known without call t: page
tables are reserved at admission, sampling parameters are per request, and the compact budget
comes from survival observed ``lag`` rounds back, already read by then.  A request that
finishes in call t wasted its share of call t+1, whose output for it is ignored; its K/V
writes stay inside its own reserved pages (the lookahead covers two calls' blocks).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.calibration.metrics import ConfidenceMetricsAccumulator
from dspark_jax.calibration.sts import StsCalibration
from dspark_jax.engine.background_compile import own_or_cover
from dspark_jax.engine.model_runner import abstract
from dspark_jax.engine.request import Request, Status
from dspark_jax.engine.worker import prefill_sampling_struct, prefill_shapes
from dspark_jax.forward_batch import shape_struct
from dspark_jax.kv_cache import KVCache
from dspark_jax.layers.layer_split import split_layers
from dspark_jax.logit_processors import CONSTRAINED
from dspark_jax.logprobs import top_width
from dspark_jax.parallel.host import prefetch, to_host
from dspark_jax.spec.common.stats import commit_rounds, round_seconds
from dspark_jax.spec.common.tiers import TokenTiers
from dspark_jax.spec.common.worker import DraftWorker
from dspark_jax.spec.dspark.planner import RoundPlan, plan_call
from dspark_jax.spec.dspark.scheduler import BudgetDecision, ConfidenceScheduler
from dspark_jax.spec.dspark.step import (
    DECODE_MODES,
    FED_FIELDS,
    FED_OUTPUTS,
    RESULT_FIELDS,
    SpecInputs,
    SpecOutputs,
    decode_mode,
    prefill_step,
    spec_rounds,
)


@dataclasses.dataclass
class _Call:
    """A dispatched, unread call: its device outputs and the host facts needed to commit it."""
    reqs: list[Request]
    results: jax.Array  # the host-read results, packed into one int32 buffer
    next_anchor: jax.Array  # [R] fed to the next call on the device, never read
    next_start: jax.Array
    plan: RoundPlan
    step: int  # the call's first round
    slots: np.ndarray
    generations: np.ndarray
    dispatched_at: float
    overlapped: bool  # dispatched while another call was in flight
    processed: int | bool = False  # ran the processed executable (its results carry logprobs)


class DSparkWorker(DraftWorker):
    name = "dspark"

    def __init__(self, drafter, spec):
        super().__init__(drafter, spec)
        self.gamma = G = drafter.config.block_size
        self.rounds = spec.rounds_per_call
        sts = spec.sts or StsCalibration.identity(G)
        if sts.block_size != G:
            raise ValueError(f"STS file has {sts.block_size} temperatures for block size {G}")
        self.sts_temperatures = jnp.asarray(sts.temperatures, jnp.float32)

    def kv_bytes_per_token(self, dtype) -> int:
        d = self.drafter.config
        return 2 * d.num_layers * d.num_key_value_heads * d.head_dim * jnp.dtype(dtype).itemsize

    def allocate_draft_cache(self, num_pages, page_size, dtype):
        d, par = self.drafter.config, self.engine.parallel
        shape = (d.num_layers, num_pages, page_size, d.num_key_value_heads, d.head_dim)
        if par.default:
            return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        return par.allocate_kv(*shape[:4], d.head_dim, dtype)

    def bind(self, engine) -> None:
        spec, G, n = self.spec, self.gamma, self.rounds
        # Positions past the last token a call may write: a block per round, twice that with a
        # call in flight (it starts up to n x (G + 1) positions further on).
        self.lookahead = (2 if engine.ec.overlap else 1) * n * (G + 1)
        if engine.runner.split:  # the drafter's layers unroll as the target's do
            split_layers(self.drafter.layers)
        super().bind(engine)
        # A call's last round must see survival the host has read: 2 x n rounds back overlapped.
        self._lag = max(spec.lag, (2 if engine.ec.overlap else 1) * n)
        # "derive": the table is profiled once the executables exist (calibrate); until then the
        # worker compiles for trimming and for plain decode steps, whatever the table turns out to be.
        self._derive = isinstance(spec.cost_table, str) and spec.mode != "static"
        self._forced: int | str | None = None  # profiling: see force()
        self.use_table(None if self._derive else spec.cost_table)
        self._derive_pending = self._derive
        top = max(engine.decode_buckets) * (G + 1)
        self.tiers = TokenTiers(G, engine.decode_buckets, tier_step=max(64, -(-top // 8 // 64) * 64))
        runner = engine.runner
        self._prefill_jit = self.jit_step(functools.partial(
            prefill_step, runner.graphdef, self.drafter_def, target_options=runner.forward_options(True)),
            donate=(2, 3, 4), ins=("kv", "kv", None, None, None), outs=(None, None, "kv", "kv", None))
        self._round_jit = {mode: self.jit_step(functools.partial(
            spec_rounds, runner.graphdef, self.drafter_def, mode=mode, page_size=engine.pool.page_size,
            target_options=runner.forward_options(False)),
            donate=(2, 3, 4), packed_input=5, packed_output=True, static=("num_tokens",),
            ins=("kv", "kv", None, None, None, None), outs=(None, None, "kv", "kv", None))
            for mode in ("static", "compact", "cap-accept", *DECODE_MODES)}
        R, par = engine.ec.max_running_requests, engine.parallel
        self._no_feed = (par.zeros((R,), jnp.int32), par.zeros((R,), jnp.int32))
        self.sts_temperatures = par.put(self.sts_temperatures)
        self._step = 0  # rounds dispatched
        self._last_read_at = 0.0
        self._batch_slots = None  # (the last call's requests, their slots, their generations)
        # round_log: (batch size, budget K, tier, tokens verified, seconds, overlapped) per round
        self.new_stats("predicted_step_s", "measured_step_s", "round_log")
        # Online calibration of the confidence head, where labels are uncensored (full blocks).
        self.confidence_metrics = ConfidenceMetricsAccumulator(G) if self.mode != "compact" else None
        self._recorder = None
        if spec.record_sts_dir:
            from dspark_jax.calibration.recorder import StsRecorder

            self._recorder = StsRecorder(spec.record_sts_dir, G)

    def use_table(self, table) -> None:
        """Schedule rounds with this cost table (None: verify everything)."""
        spec = self.spec
        self._derive_pending = False
        self.scheduler = sched = ConfidenceScheduler(self.gamma, table, lag=self._lag,
                                                     min_predicted_gain=spec.min_predicted_gain)
        priced = spec.mode != "static" and table is not None
        # Rounds decided from lagged survival (a lag ring): the table can trim, or make a round a
        # plain decode step.  Otherwise every block is verified, priced from the table alone.
        self._schedules = priced and (sched.can_trim or sched.can_decode)
        self._trims = self._schedules and sched.can_trim
        self._prices_verify_all = priced and not self._schedules

    @property
    def needs_calibration(self) -> bool:
        """Whether the cost table is still to be derived (Engine.calibrate)."""
        return self._derive_pending

    def calibrate(self, cached_only: bool = False) -> None:
        """Derive the cost table on this device when the config asks for it (spec.cost_table
        "derive"): profile rounds in the engine's loop, then schedule with the fit.  The
        profiling rounds leave no trace in the statistics.  cached_only: take a cached table if
        there is one, else leave the derivation pending."""
        if self._derive_pending:
            from dspark_jax.spec.dspark.profile import derive_cost_table

            self._derive_pending = False  # (the profile steps the engine, which would calibrate again)
            table = derive_cost_table(self, measure=not cached_only)
            if table is None:
                self._derive_pending = True
                return
            self.new_stats("predicted_step_s", "measured_step_s", "round_log")
            if self.confidence_metrics is not None:
                self.confidence_metrics = ConfidenceMetricsAccumulator(self.gamma)
            self.use_table(table)

    def speculation_pays(self) -> bool:
        """Whether the derived cost table lets any round beat a plain decode step at some batch
        size, even with every draft accepted.  False only for a table measured here that prices
        decode steps and says no: then the drafter is dead weight, and the engine serves plain
        decode steps instead.  (A table given by the user is taken as given: its rounds may still
        be decode rounds, which keep the drafter's context current.)"""
        table, G = self.scheduler.cost_table, self.gamma
        if not self._derive or table is None or not table.prices_decode:
            return True
        gain = 1.0 + (self.spec.min_predicted_gain or 0.0)
        for bs in self.engine.decode_buckets:
            K = np.arange(bs * G + 1)
            if np.max((bs + K) / table.predict(bs, K)) >= bs / table.predict_decode(bs) * gain:
                return True
        return False

    def force(self, budget: int | str | None) -> None:
        """Profiling: every round from now on verifies exactly ``budget`` drafts beyond the
        anchors (capped at the batch's blocks; the configured verify mode's executables), or is
        a plain decode step ("decode"); None gives the rounds back to the scheduler."""
        if not (budget is None or budget == "decode" or (isinstance(budget, int) and budget >= 0)):
            raise ValueError(f"a forced budget is an integer >= 0, 'decode' or None, got {budget!r}")
        self._forced = budget

    @property
    def mode(self) -> str:
        """The verify mode rounds run: a worker that can never trim verifies every block, so it
        runs (and compiles) static rounds; a forced budget (profiling) keeps the configured mode."""
        spec = self.spec
        keeps = spec.mode == "static" or self._trims or self._derive or self._forced is not None
        return spec.mode if keeps else "static"

    # -- compilation ---------------------------------------------------------------------------
    def keys(self):
        e = self.engine
        # draft-and-verify rounds compile longest, the widest first; prefill (scanned) shortest
        shapes = [(self.mode, T, S) for T, S in self.tiers.shapes(trimmed=self.mode != "static")][::-1]
        if self._decodes:
            shapes += [(mode, T, T) for T in e.decode_buckets[::-1] for mode in DECODE_MODES]
        return [("round", mode, T, S, P, processed) for mode, T, S in shapes
                for P in e.page_widths[::-1] for processed in self.processed_variants()] + [
            ("prefill", T, S, True) for T, S in prefill_shapes(e)][::-1]

    def sampled_only(self, key):
        return key[:2] == ("round", "decode")

    def describe(self, key):
        if key[0] == "prefill":
            return f"dspark prefill tokens={key[1]} seqs={key[2]}"
        mode, T, S, P, processed = key[1:]
        return f"dspark {mode} round tokens={T} rows={S} pages={P}{' processed' if processed else ''}"

    def _prefill_executable(self, T: int, S: int, level: int | bool = True):
        e = self.engine
        lower = lambda: self._prefill_jit.lower(
            abstract(e.runner.state), abstract(self.drafter_state), abstract(e.runner.cache), abstract(self.dcache),
            abstract(self.lstate(level)), shape_struct(T, S, e.pages_per_seq, S), prefill_sampling_struct(e, S))
        return self.executable(("prefill", T, S, level), lower, optional=level == CONSTRAINED)

    @property
    def _decodes(self) -> bool:
        """Whether rounds may be plain decode steps (a cost table that can say no window pays)."""
        return bool(self._derive or (self._schedules and self.scheduler.can_decode))

    def widest(self, processed: bool) -> list[tuple]:
        rounds = [self._widest_round(mode, processed) for mode in (self.mode, *(DECODE_MODES if self._decodes else ()))]
        return rounds if processed else [self.widest_prefill(), *rounds]

    def _widest_round(self, mode: str, processed: int | bool) -> tuple:
        """The key of a round kind's widest shape: the most tokens, rows and pages it compiles
        (the top tier holds the largest batch in every mode)."""
        e, top = self.engine, self.tiers.max_tier
        T, S = (max(e.decode_buckets),) * 2 if mode in DECODE_MODES else (top, self.tiers.slots(top))
        return ("round", mode, T, S, max(e.page_widths), processed)

    def _input_pack(self, S: int, P: int):
        slots, rounds = self.engine.ec.max_running_requests, self.rounds
        return self.pack(("inputs", S, P), lambda: SpecInputs.shapes(S, P, slots, rounds), FED_FIELDS)

    def _result_pack(self, S: int, processed: int | bool = False):
        top = top_width(self.engine.config.vocab_size) if processed else 0
        return self.pack(("results", S, bool(processed)),
                         lambda: SpecOutputs.result_shapes(self.rounds, S, self.gamma, top), FED_OUTPUTS)

    def _round_executable(self, mode: str, T: int, S: int, P: int, processed: int | bool = False):
        """processed: the variant with logit processors and logprobs (dspark_jax/logit_processors.py);
        CONSTRAINED: with grammar masks too."""
        e, pack = self.engine, self._input_pack(S, P)
        lower = lambda: self._round_jit[mode].lower(
            abstract(e.runner.state), abstract(self.drafter_state), abstract(e.runner.cache), abstract(self.dcache),
            abstract(self.lstate(processed)), pack.spec(), abstract(self._no_feed), abstract(self.sts_temperatures),
            num_tokens=T, pack=pack, out_pack=self._result_pack(S, processed))
        return self.executable(("round", mode, T, S, P, processed), lower, optional=bool(processed))

    # -- steps ---------------------------------------------------------------------------------
    def prefill(self, chunks):
        batch, samp, level, fn = self.prefill_inputs(chunks)
        runner = self.engine.runner
        tokens, lp, runner.cache, self.dcache, lstate = fn(runner.state, self.drafter_state, runner.cache, self.dcache,
                                                           self.lstate(level), batch, samp)
        self.keep_lstate(lstate)
        return tokens, lp

    def feeds(self, prev, reqs):
        return True  # row by row: a request the previous call did not hold starts from the host

    def _decisions(self, bs: int, step: int, slots, generations) -> list:
        """Each round's budget decision, from host facts only."""
        spec, sched, full = self.spec, self.scheduler, bs * self.gamma
        if self._forced == "decode":
            return [BudgetDecision(0, 0, float("nan"), None, None, decode=True)] * self.rounds
        if self._forced is not None:
            K = min(self._forced, full) if spec.mode != "static" else full
            price = sched.price(bs, K) if sched.cost_table is not None else None
            return [BudgetDecision(K, K, float("nan"), price, None)] * self.rounds
        if self._prices_verify_all:  # a table flat in K: verify all, priced once
            return [sched.verify_all(bs)] * self.rounds
        if self._schedules:
            return [sched.decide_lagged(step + j, generations, slots) for j in range(self.rounds)]
        return [BudgetDecision(full, full, float("nan"), None, None)] * self.rounds

    def dispatch(self, reqs, prev: _Call | None) -> _Call:
        """prev: the in-flight (unread) call, whose device outputs feed the anchors and positions
        of the requests it holds (None, and for any other request: the host's committed state,
        which is current because no unread call holds them)."""
        G, bs = self.gamma, len(reqs)
        batch = tuple(reqs)  # a slot and its generation stay fixed while a request runs
        if self._batch_slots is None or self._batch_slots[0] != batch:
            slots = np.array([r.slot for r in reqs], np.int64)
            self._batch_slots = (batch, slots, np.array([r.slot_generation for r in reqs], np.int64))
        _, slots, generations = self._batch_slots
        step = self._step
        plan = plan_call(bs, self._decisions(bs, step, slots, generations), gamma=G, mode=self.mode, tiers=self.tiers,
                         fill_tier=self._trims,
                         price=self.scheduler.price if self._trims else None)
        arrays = self.batch_arrays(reqs, plan.rows)
        if plan.mode == "decode":
            plan = dataclasses.replace(plan, mode=decode_mode(arrays.temperature))
        P, processed = arrays.table.shape[1], arrays.processed
        key, fn = own_or_cover(self._compiled, ("round", plan.mode, plan.tier, plan.rows, P, processed),
                               self.step_executable, dims=(2, 3, 4),  # compiled before the clock starts
                               widest=self._widest_round(plan.mode, processed) if self.pads(processed) else None)
        if key[2:5] != (plan.tier, plan.rows, P):  # padded onto a wider shape (not the one priced)
            plan = dataclasses.replace(plan, tier=key[2], rows=key[3], predicted_s=None)
            arrays, P = self.batch_arrays(reqs, key[3], pages=key[4]), key[4]
        S = plan.rows
        fed_index = np.full(S, -1, np.int32)
        if prev is not None and prev.reqs == reqs:  # the same batch as the call in flight: fed row by row
            fed_index[:bs] = np.arange(bs, dtype=np.int32)
        elif prev is not None:
            prev_row = {id(r): i for i, r in enumerate(prev.reqs)}
            fed_index[:bs] = [prev_row.get(id(r), -1) for r in reqs]
        anchor, start = np.zeros(S, np.int32), np.zeros(S, np.int32)
        host = np.flatnonzero(fed_index[:bs] < 0)
        if host.size:  # requests no unread call holds start from the host's committed state
            anchor[host] = [reqs[i].output_ids[-1] for i in host]
            start[host] = [reqs[i].total_len - 1 for i in host]
        fed = (prev.next_anchor, prev.next_start) if prev is not None else self._no_feed
        inp = SpecInputs(anchor=anchor, start=start, page_table=arrays.table, live=arrays.live, num_seqs=np.int32(bs),
                         budget=np.asarray(plan.budgets, np.int32), temperature=arrays.temperature,
                         top_k=arrays.top_k, top_p=arrays.top_p, seed=arrays.seed, logit_slot=arrays.logit_slot,
                         fed_anchor=fed[0], fed_start=fed[1], fed_index=fed_index)
        self._step = step + self.rounds  # (not before: a dispatch that waits on a compile changes nothing)
        runner, pack = self.engine.runner, self._input_pack(S, P)
        t0 = time.perf_counter()
        results, (next_anchor, next_start), runner.cache, self.dcache, lstate = fn(
            runner.state, self.drafter_state, runner.cache, self.dcache, self.lstate(processed), pack.pack(inp),
            pack.device(inp), self.sts_temperatures)
        self.keep_lstate(lstate)
        prefetch(results)
        return _Call(reqs, results, next_anchor, next_start, plan, step, slots, generations, t0, prev is not None,
                     processed)

    def read(self, call: _Call):
        """Read a dispatched call (the one host sync per call) and commit its rounds in order."""
        stacked = self._result_pack(call.plan.rows, call.processed).unpack_host(to_host(call.results))
        now = time.perf_counter()
        measured = round_seconds(call.dispatched_at, self._last_read_at, now, self.engine.runner.take_compile_spans(),
                                 self.rounds)
        self._last_read_at = now
        if call.plan.predicted_s is not None:
            self.stats["predicted_step_s"].extend([call.plan.predicted_s] * self.rounds)
            self.stats["measured_step_s"].extend([measured] * self.rounds)
        events = []
        for j in range(self.rounds):
            out = SpecOutputs(*(getattr(stacked, f)[j] for f in RESULT_FIELDS), None, None)
            events += self._commit_round(call, j, out, measured)
        return events

    def _commit_round(self, call: _Call, j: int, out: SpecOutputs, measured: float):
        """Round j of a read call: statistics, calibration and scheduler records, then the commit."""
        G, bs, budget = self.gamma, len(call.reqs), call.plan.budgets[j]
        self.stats["round_log"].append((bs, budget, call.plan.tier, int(out.verify_lens[:bs].sum()), measured,
                                        call.overlapped))
        # Rows of requests that finished in an earlier round ran past their end: keep them out of
        # the calibration data (the lag ring drops them by slot generation).
        alive = np.array([r.status is not Status.FINISHED for r in call.reqs])
        drafted = call.plan.mode not in DECODE_MODES  # a plain decode step drafts nothing: no survival to learn from
        if self.confidence_metrics is not None and drafted:
            labels = np.arange(G)[None, :] < out.block_accept[:bs, None]
            self.confidence_metrics.update(out.survival[:bs][alive], labels[alive])
        if self._schedules and drafted:
            self.scheduler.observe(call.step + j, out.survival[:bs], call.generations, slots=call.slots)
        self.stats["rounds"] += 1
        done = commit_rounds(self.stats, call.reqs, out.drafts, out.num_accepted, out.bonus, out.verify_lens,
                             out.block_accept, out.logprobs if call.processed else None)
        if self._recorder is not None and drafted:  # after the commit: a row knows whether its request ended here
            final = np.array([r.status is Status.FINISHED for r in call.reqs])[alive]
            self._recorder.add(out.confidence_logits[:bs][alive], out.block_accept[:bs][alive], final)
        return [(r, committed) for r, _, committed in done]

    # -- studies -------------------------------------------------------------------------------
    def round_caller(self, mode: str, T: int, S: int, P: int, inp: SpecInputs):
        """``call()`` dispatching the compiled round (mode, tier T, S rows, P-page tables) on
        inputs the caller built, fed by no earlier round, and returning its device results;
        packed once, so repeated calls time the executable and its dispatch, not the packing
        (spec/dspark/synthetic.py).  Every call overwrites the same positions: nothing commits."""
        fn, pack, runner = self._round_executable(mode, T, S, P), self._input_pack(S, P), self.engine.runner
        inp = dataclasses.replace(inp, fed_anchor=self._no_feed[0], fed_start=self._no_feed[1])
        packed = pack.pack(inp)

        def call():
            results, _, runner.cache, self.dcache, _ = fn(runner.state, self.drafter_state, runner.cache, self.dcache,
                                                          None, packed, pack.device(inp), self.sts_temperatures)
            return results

        return call

    # -- reports -------------------------------------------------------------------------------
    def summary(self) -> dict:
        st = self.stats
        out = {**super().summary(), "mode": self.spec.mode}
        if st["predicted_step_s"]:
            pred, meas = np.asarray(st["predicted_step_s"]), np.asarray(st["measured_step_s"])
            out["step_time"] = {"predicted_mean_s": float(pred.mean()), "measured_mean_s": float(meas.mean()),
                                "median_relative_error": float(np.median(np.abs(pred - meas) / meas))}
        if self.confidence_metrics is not None and st["accept_lens"]:
            out["confidence"] = self.confidence_metrics.summary()
        return out

    def set_record_group(self, name: str) -> None:
        """Tag the STS rows recorded from now on with a group name (no-op when not recording)."""
        if self._recorder is not None:
            self._recorder.set_group(name)

    def flush_records(self):
        """Write any buffered STS calibration rows to a shard (no-op when not recording)."""
        return self._recorder.flush() if self._recorder is not None else None

