"""SpeculativeEngine: the batch engine with DSpark drafting and verification.

Same request lifecycle as Engine (slots, KV admission, chunked prefill, stop handling); the
decode step is replaced by a speculative round (dspark_jax/spec/dspark/step.py).  The target
and the drafter keep paged caches with the same page tables: a draft-context row lives at its
own position.  Each round is one executable chosen by the token tier (a function of the batch
size and the budget K, both host scalars), compiled ahead of time like the plain buckets.

Modes: static (verify the whole block), compact (verify each request's scheduled window, packed:
the tier, hence the executable, shrinks with the budget), cap-accept (verify the whole block,
commit as compact would, report the uncensored ceiling).  A compact or cap-accept engine that
can never trim (no cost table, or one flat in K: ConfidenceScheduler.can_trim) runs static
rounds, which commit what a full window would.

Overlap (EngineConfig.overlap): round t+1 is dispatched before round t is read, fed on device by
round t's next anchors and positions (row by row: a request round t did not hold, if any, starts
from the host's committed state); the host reads round t (committed tokens and small statistics:
the only device-to-host transfer) while the device runs round t+1.  Requests leaving the batch
(finished, aborted) do not break the overlap.  Everything round t+1 needs from the host is known
without round t: page tables are reserved up front, sampling parameters are per request, and the
compact budget comes from the survival observed `lag` = 2 rounds back, which has been read by
then.  A request that finishes in round t wasted its share of round t+1, whose output for it is
ignored; its K/V writes stay within its own reserved pages (the lookahead covers two calls' blocks) and
precede, in device order, any reuse of those pages.  A prefill step reads the in-flight round
first.  Dispatched behind it instead (7ad24e2), rounds with a prefill behind them took ~4.5 ms
against ~2.2 ms and the default pair at batch 64 ran 8-20% slower
(benchmarks/results/speculative_default_gpu_bs64_paired_7ad24e2.md).  The suspected cause, the
prefill's scanned layer loops blocking the host at dispatch, did not hold up: on the H200 neither
a scan nor a lax.cond blocks the host behind queued work
(benchmarks/results/probe_host_sync_gpu_446209e.md), so the cause is open.
SpeculativeConfig.overlap_admissions brings the flow back with an unrolled prefill (not yet
measured).

Block-accept estimator (compact mode, SpeculativeConfig.estimate_block_accept): brackets the
censored ceiling from later rounds' target log-probs (spec/dspark/block_accept.py).  Its probe
tokens for round t+1 depend on round t's outcome, so enabling it turns the overlap off.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.calibration.sts import StsCalibration
from dspark_jax.spec.dspark.model import DSparkDrafter
from dspark_jax.engine.engine import Engine, EngineConfig
from dspark_jax.engine.flat_state import flatten_states, with_flat_states
from dspark_jax.engine.host_pack import HostPack, with_packed_inputs, with_packed_outputs
from dspark_jax.engine.request import Status
from dspark_jax.spec.common.stats import commit_rounds, new_round_stats, summarize_rounds
from dspark_jax.forward_batch import shape_struct
from dspark_jax.kv_cache import KVCache
from dspark_jax.models.qwen3 import Qwen3ForCausalLM
from dspark_jax.spec.dspark.cost_model import AdditiveCostTable
from dspark_jax.spec.dspark.scheduler import ConfidenceScheduler
from dspark_jax.spec.dspark.step import (MODES, ROUND_RESULT_FIELDS, EstimatorLogProbs, SpecInputs, SpecOutputs,
                                         join_feed, prefill_step, spec_rounds)
from dspark_jax.spec.common.tiers import TokenTiers
from dspark_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SPEC_DEVICE_FIELDS = ("fed_anchor", "fed_start")  # left on the device by the previous round


class RoundOutputs(NamedTuple):
    """A dispatched round's device outputs: its host-read results packed into one int32 buffer
    (engine/host_pack.py: read as seven arrays they took 0.13 ms against 0.02 ms as one buffer on
    the CPU at batch 4, benchmarks/profile_dispatch.py), the next round's anchors and positions
    (fed on the device, never read), the block-accept estimator's inputs."""
    results: jax.Array
    next_anchor: jax.Array
    next_start: jax.Array
    estimate: EstimatorLogProbs | None


# SpecOutputs fields that stay on the device (or travel as their own pytree): the rest are packed
ROUND_DEVICE_FIELDS = tuple(f for f in SpecOutputs._fields if f not in ROUND_RESULT_FIELDS)


@dataclasses.dataclass
class SpeculativeConfig:
    mode: str = "static"  # static | compact | cap-accept
    sts: StsCalibration | None = None  # None: identity temperatures
    cost_table: AdditiveCostTable | None = None  # None: verify everything
    lag: int = 2
    # Trim only when the predicted throughput beats verify-all by this fraction (TensorRT-LLM's
    # config default; None: always take the argmax).  A latency-bound target's round costs nearly
    # the same at any verify length, so noise in the profiled table or in the confidences would
    # otherwise buy trims that lose accepted tokens and save no time: with the default pair at
    # batch 64 on the H200, compact with the table and no guard ran 5-23% slower than verify-all
    # (benchmarks/results/speculative_default_gpu_bs8-64_d8852f2.md).
    min_predicted_gain: float | None = 0.04
    # Learn the cost table's level from measured rounds (moving-average weight, e.g. 0.1; None:
    # the raw table).  See dspark_jax/spec/dspark/step_time_correction.py.  Off by default: the
    # windows then depend on wall-clock timing, so above temperature 0 a fixed seed no longer
    # reproduces its output run to run (the distribution stays exact; greedy output is unchanged).
    step_time_correction: float | None = None
    # STS data collection: write (raw confidence logits, accepted-draft counts) shards here.
    # Needs full-block verification (static or cap-accept) and identity temperatures, or the
    # labels would be censored by trimming / the logits already scaled.
    record_sts_dir: str | None = None
    record_shard_rows: int = 4096
    # compact mode: estimate the uncensored ceiling (temperature-sampling rows only; no overlap)
    estimate_block_accept: bool = False
    # Finer token tiers between the ladder's bs * (gamma + 1): every tier_step tokens up to the
    # largest tier.  None: an eighth of the largest tier, rounded up to 64 tokens (at most ~8 more
    # executables; a 64-request batch at gamma 7 gets 192, 320, 384, 448 besides 256 and 512);
    # 0: ladder tiers only.
    tier_step: int | None = None
    # Profiling (benchmarks/profile_sps.py): compact rounds verify exactly this many draft tokens
    # beyond the anchors (capped at bs * gamma) instead of the scheduler's budget.
    forced_budget: int | None = None
    # Drafts are sampled at this multiple of each request's temperature (and judged with the same
    # draft distribution, so the output still follows the target exactly; greedy rows are
    # unaffected).  For the embedded pair at T=1, 1.0 is best on code and verse and sharper drafts
    # (0.6) help math only (CPU: benchmarks/results/draft_temperature_scale_t1_cpu_6622b87.md).
    draft_temperature_scale: float = 1.0
    # A second round executable per tier for all-greedy batches, chosen on the host: drafting
    # takes the argmax without random draws and acceptance the exact-match rule without the
    # target distribution over the vocabulary (the sort of its top-k / top-p cut already runs only
    # when some row asks for one: sampling._filtered_logits).  Off until measured: it doubles the
    # round executables compiled at start-up (the default pair's tiers took ~200 s to compile on
    # the H200 without it).
    greedy_rounds: bool = False
    # Admissions without draining the overlap (_prefill_step): a prefill is dispatched behind the
    # round in flight, then the next round, which starts the requests it completes from its
    # sampled tokens on the device.  The prefill then runs with unrolled loops and without
    # sampling's device-side conditional.  With its scanned layer loops this flow made the
    # default pair at batch 64 8-20% slower (benchmarks/results/speculative_default_gpu_bs64_paired_7ad24e2.md),
    # for a reason not yet found (neither construct blocks the host at dispatch:
    # probe_host_sync_gpu_446209e.md).  Off until measured in this form; needs EngineConfig.overlap.
    overlap_admissions: bool = False
    # Speculative rounds per dispatch (spec/dspark/step.py spec_rounds): round j + 1 of a call is
    # fed by round j on the device and the host reads them together, so its work per round (the
    # executable's dispatch above all) is split n ways, for a loop the host otherwise paces.  The
    # cost: the budget of each round comes from survival n rounds staler (the lag grows to
    # n x 2 overlapped), a request that finishes inside a call wastes its later rounds there, and
    # the KV lookahead covers n blocks more.  Each round executable is n rounds unrolled (it
    # compiles longer).  Paired in one run at T=1, batch 64 on the H200, one round per
    # dispatch ran 0.85 / 0.97 / 0.79x two on code / math / verse, its steady rounds 1.06-1.56 ms
    # against 1.00-1.12 ms (speculative_default_gpu_bs64_t1_r2_paired_5c988af.md).  Off by
    # default until measured at batch 1 and 8 (and for its start-up compile time).
    rounds_per_call: int = 1


@dataclasses.dataclass
class _Round:
    """A dispatched, unread round: its device outputs and the host facts needed to commit it."""
    reqs: list
    out: RoundOutputs
    rows: int  # S, the round's padded request rows
    slots: np.ndarray
    generations: np.ndarray
    step: int  # the call's first round
    budgets: list[int]  # one a round
    tier: int
    predicted_s: float | None  # mean predicted round time
    table_s: list[float]  # the cost table's own prediction for each round (no level correction)
    dispatched_at: float
    overlapped: bool  # dispatched while another round was in flight (steady state)


class SpeculativeEngine(Engine):
    def __init__(self, model: Qwen3ForCausalLM, tokenizer: Tokenizer | None, drafter: DSparkDrafter,
                 config: EngineConfig | None = None, spec: SpeculativeConfig | None = None):
        ec = dataclasses.replace(config or EngineConfig(), precompile=False)  # no plain decode buckets
        self.drafter = drafter  # before sizing the page pool: the draft cache shares its pages
        super().__init__(model, tokenizer, ec)
        self.spec = spec or SpeculativeConfig()
        if self.spec.mode not in MODES:
            raise ValueError(f"verify mode must be one of {MODES}, got {self.spec.mode!r}")
        if not (math.isfinite(self.spec.draft_temperature_scale) and self.spec.draft_temperature_scale > 0):
            raise ValueError(f"draft_temperature_scale must be a finite number > 0, got {self.spec.draft_temperature_scale}")
        dcfg = drafter.config
        self.gamma = G = dcfg.block_size
        self.rounds = int(self.spec.rounds_per_call)
        if self.rounds < 1:
            raise ValueError(f"rounds_per_call must be >= 1, got {self.spec.rounds_per_call}")
        self.estimator = None
        if self.spec.estimate_block_accept:
            if self.rounds != 1:
                raise ValueError("the block-accept estimator probes one round at a time: rounds_per_call must be 1")
            if self.spec.mode != "compact":
                raise ValueError("the block-accept estimator is for compact mode (cap-accept measures the ceiling)")
            from dspark_jax.spec.dspark.block_accept import BlockAcceptEstimator

            self.estimator = BlockAcceptEstimator(G)
        self.overlap = self.ec.overlap and self.estimator is None
        # Positions past the last token a call may write: a block per round, twice that with an
        # overlapped call in flight (it starts up to rounds x (G + 1) positions further on).
        self.lookahead = (2 if self.overlap else 1) * self.rounds * (G + 1)
        sts = self.spec.sts or StsCalibration.identity(G)
        if sts.block_size != G:
            raise ValueError(f"STS file has {sts.block_size} temperatures for block size {G}")
        self.sts_temperatures = jnp.asarray(sts.temperatures, jnp.float32)
        self._recorder = None
        if self.spec.record_sts_dir:
            if self.spec.mode == "compact":
                raise ValueError("STS data collection needs static or cap-accept mode: compact censors labels")
            if not sts.is_identity:
                raise ValueError("STS data collection needs identity temperatures (no --sts-path)")
            from dspark_jax.calibration.recorder import StsRecorder

            self._recorder = StsRecorder(self.spec.record_sts_dir, G, self.spec.record_shard_rows)
        # A call's last round must see survival the host has read: with a call in flight that
        # is 2 x rounds back (rounds back without overlap).
        lag = max(self.spec.lag, (2 if self.overlap else 1) * self.rounds)
        self.scheduler_conf = ConfidenceScheduler(G, self.spec.cost_table, lag=lag,
                                                  min_predicted_gain=self.spec.min_predicted_gain,
                                                  correction_weight=self.spec.step_time_correction)
        # Whether rounds take their budget from the confidence scheduler, which keeps a lag ring
        # for it.  Not without a cost table (verify-all) nor with a forced budget (profiling); nor
        # with a table flat in K under the min-gain guard, which can only ever verify everything
        # (ConfidenceScheduler.can_trim): such rounds verify all, priced by the table without
        # survival (_prices_verify_all), and skip the ranking and the ring, host work a
        # host-paced loop waits for.
        priced = self.spec.mode != "static" and self.spec.cost_table is not None and self.spec.forced_budget is None
        self._schedules = priced and self.scheduler_conf.can_trim
        self._prices_verify_all = priced and not self._schedules
        # A compact or cap-accept engine that can never trim (no cost table, or one flat in K)
        # verifies every block, which is what a static round does and commits: its rounds run
        # the static executables, the only ones it compiles (no window ranking on the device, no
        # second set of executables; a round with a forced budget still runs its own mode).
        self._verifies_all = self.spec.mode != "static" and not self._schedules and self.estimator is None
        top = max(self.decode_buckets) * (G + 1)
        step = self.spec.tier_step if self.spec.tier_step is not None else max(64, -(-top // 8 // 64) * 64)
        self.tiers = TokenTiers(G, self.decode_buckets, tier_step=step or None)
        runner = self.runner
        self.tcache, runner.cache = runner.cache, None
        L, N, ps, Hkv, D = self.tcache.k.shape
        zeros = lambda: jnp.zeros((dcfg.num_layers, N, ps, Hkv, D), self.tcache.k.dtype)
        self.dcache = KVCache(zeros(), zeros())
        self.target_def, self.target_state = runner.graphdef, runner.state
        self.drafter_def, self.drafter_state = nnx.split(drafter)
        # The steps take both states as flat leaf lists (engine/flat_state.py: cheaper dispatch).
        self.state_args, state_defs = flatten_states(self.target_state, self.drafter_state)
        self.overlap_admissions = self.overlap and self.spec.overlap_admissions
        prefill_options = (dict(self.draft_step_options(prefill=False), sample_variant="stochastic")
                           if self.overlap_admissions else self.draft_step_options(prefill=True))
        self._prefill_jit = jax.jit(
            with_flat_states(functools.partial(prefill_step, self.target_def, self.drafter_def, **prefill_options),
                             state_defs), donate_argnums=(2, 3))
        # A round takes its host inputs as one packed buffer (engine/host_pack.py: one transfer).
        # With SpeculativeConfig.greedy_rounds every tier also gets a greedy round (no sampling
        # work), dispatched when every request in the batch is greedy.
        self._spec_jit = {}
        for mode in MODES:
            for greedy in (False, True):
                self._spec_jit[mode, greedy] = jax.jit(
                    with_packed_outputs(with_packed_inputs(with_flat_states(
                        functools.partial(spec_rounds, self.target_def, self.drafter_def, rounds=self.rounds,
                                          mode=mode, page_size=ps,
                                          draft_temperature_scale=float(self.spec.draft_temperature_scale),
                                          greedy=greedy, **self.draft_step_options(prefill=False)),
                        state_defs), index=4)),
                    donate_argnums=(2, 3), static_argnames=("num_tokens", "pack", "out_pack"))
        self._spec_packs: dict[tuple[int, int], HostPack] = {}  # by (S, P): the round inputs' layout
        self._result_packs: dict[int, HostPack] = {}  # by S: the round results' layout
        self._compiled: dict = {}
        self._num_probes = self.estimator.max_pending if self.estimator is not None else 0
        self._step = 0  # rounds dispatched
        R = self.ec.max_running_requests
        self._no_feed = (jnp.zeros((R,), jnp.int32), jnp.zeros((R,), jnp.int32))
        if self.overlap_admissions:
            i32, Sp = jax.ShapeDtypeStruct, self.prefill_seqs
            self._join_feed = jax.jit(join_feed).lower(i32((R,), np.int32), i32((R,), np.int32),
                                                       i32((Sp,), np.int32), i32((3, Sp), np.int32)).compile()
        self._last_read_at = 0.0
        # (start, end) of the shapes compiled on first use since the last read (precompile off):
        # the host compiled them while a round ran, so that round's measured time leaves them out.
        self._compiles_since_read: list[tuple[float, float]] = []
        self._slot_of: dict[str, int] = {}
        self._slot_gen = np.full(self.ec.max_running_requests, -1, np.int64)
        self._batch_slots = None  # (the last round's requests, their slots, their slot generations)
        self._gen_counter = 0
        # round_context: (tokens committed, overlapped, batch size, budget K) of each round with a
        # prediction, beside predicted / table / measured, so a prediction error can be traced to
        # what the table cannot see (rounds committing many tokens; rounds after a drain, run
        # without overlap) and another correction can be replayed on the same rounds offline
        self.stats = new_round_stats("predicted_step_s", "table_step_s", "measured_step_s", "round_context",
                                     "round_log")
        from dspark_jax.calibration.metrics import ConfidenceMetricsAccumulator

        # Online calibration of the confidence head, where labels are uncensored (full-block verify).
        uncensored = self.spec.mode != "compact" or (self._verifies_all and self.spec.forced_budget is None)
        self.confidence_metrics = ConfidenceMetricsAccumulator(G) if uncensored else None
        self.compile_seconds = self._compile_all() if (config or EngineConfig()).precompile else 0.0

    def _extra_kv_bytes_per_token(self, model) -> int:
        d = self.drafter.config
        return 2 * d.num_layers * d.num_key_value_heads * d.head_dim * jnp.dtype(model.dtype).itemsize

    @classmethod
    def from_pretrained(cls, path, draft_path, config: EngineConfig | None = None,
                        spec: SpeculativeConfig | None = None, *, block_size: int | None = None,
                        sts_from_folder: bool = True) -> "SpeculativeEngine":
        """Target folder (Hugging Face Qwen3) + drafter folder (dspark_jax/spec/dspark/checkpoint.py).

        With no ``spec.sts``, the drafter folder's own sts.json calibrates the confidences (as the
        CLI and the server do), unless ``sts_from_folder`` is False or the engine records STS data
        (which needs the raw head)."""
        from dspark_jax.checkpoint import load_model
        from dspark_jax.spec.dspark.checkpoint import drafter_sts_path, load_drafter
        from dspark_jax.errors import CheckpointError

        ec = config or EngineConfig()
        dtype = ec.dtype or ("float32" if jax.default_backend() == "cpu" else None)
        tcfg, model = load_model(path, dtype=dtype)
        dcfg, drafter = load_drafter(draft_path, dtype=model.dtype)
        for f in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(dcfg, f) != getattr(tcfg, f):
                raise CheckpointError(f"drafter {draft_path} does not fit target {path}: {f} {getattr(dcfg, f)} != {getattr(tcfg, f)}")
        if block_size is not None and block_size != dcfg.block_size:
            raise CheckpointError(f"--block-size {block_size} differs from the drafter's trained block size {dcfg.block_size}")
        spec = spec or SpeculativeConfig()
        sts_path = drafter_sts_path(draft_path)
        if spec.sts is None and sts_from_folder and not spec.record_sts_dir and sts_path is not None:
            spec = dataclasses.replace(spec, sts=StsCalibration.load(sts_path))
        return cls(model, Tokenizer.from_folder(path), drafter, ec, spec)

    # -- compilation ------------------------------------------------------------------------
    def _spec_shapes(self):
        mx = self.ec.max_running_requests
        return [(t, min(t, mx)) for t in self.tiers.tiers]

    def _round_mode(self) -> str:
        """The mode a round runs in: the engine's, or static when it verifies every block."""
        return "static" if self._verifies_all and self.spec.forced_budget is None else self.spec.mode

    def _compile_all(self) -> float:
        t0 = time.perf_counter()
        for t in self.prefill_buckets:
            self._compiled_prefill((t, self.prefill_seqs, self.prefill_seqs))
        mode = self._round_mode()
        for T, S in self._spec_shapes():
            for P in self.page_widths:
                for greedy in ((False, True) if self.spec.greedy_rounds else (False,)):
                    self._compiled_spec(T, S, P, greedy, mode)
        return time.perf_counter() - t0

    def _abstract(self, tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)

    def _compiled_prefill(self, key):
        if key not in self._compiled:
            T, S, R = key
            samp = tuple(jax.ShapeDtypeStruct((R,), d) for d in (np.float32, np.int32, np.float32, np.uint32, np.int32))
            self._compiled[key] = self._compile(self._prefill_jit.lower(
                *self.state_args, self._abstract(self.tcache), self._abstract(self.dcache),
                shape_struct(T, S, self.pages_per_seq, R), samp))
        return self._compiled[key]

    def _compile(self, lowered):
        """Compile, noting when: a compile made while a round runs is left out of its time (_read)."""
        t0 = time.perf_counter()
        compiled = lowered.compile()
        self._compiles_since_read.append((t0, time.perf_counter()))
        return compiled

    def _compiled_spec(self, T: int, S: int, P: int, greedy: bool = False, mode: str | None = None):
        mode = mode or self.spec.mode
        key = ("spec", mode, T, S, P, greedy)
        if key not in self._compiled:
            s = jax.ShapeDtypeStruct
            i32 = np.int32
            R = self.ec.max_running_requests
            inp = SpecInputs(s((S,), i32), s((S,), i32), s((S, P), i32), s((S,), np.bool_), s((), i32),
                             s((self.rounds,), i32), s((S,), np.float32), s((S,), i32), s((S,), np.float32), s((S,), np.uint32),
                             s((R,), i32), s((R,), i32), s((S,), i32), s((S, self.gamma + 1, self._num_probes), i32))
            pack = self._spec_packs.setdefault((S, P), HostPack.of(inp, device_fields=SPEC_DEVICE_FIELDS))
            G, f32, n = self.gamma, np.float32, self.rounds  # confidences as float32 (bf16 on the GPU: exact)
            results = SpecOutputs(s((n, S, G), i32), s((n, S), i32), s((n, S), i32), s((n, S), i32), s((n, S), i32),
                                  s((n, S, G), f32), s((n, S, G), f32), None, None, None)
            results_pack = self._result_packs.setdefault(S, HostPack.of(results, ROUND_DEVICE_FIELDS))
            self._compiled[key] = self._compile(self._spec_jit[mode, greedy].lower(
                *self.state_args, self._abstract(self.tcache), self._abstract(self.dcache), pack.spec(),
                pack.device(inp), self._abstract(self.sts_temperatures), num_tokens=T, pack=pack,
                out_pack=results_pack))
        return self._compiled[key]

    def _run_round(self, T: int, S: int, inp: SpecInputs, greedy: bool = False, mode: str | None = None) -> RoundOutputs:
        """Dispatch the compiled round of tier (T, S) on `inp` (host fields packed into one transfer,
        and the results to read packed into one on the way back); the caches are donated and
        replaced.  mode: the round's verify mode (default: the engine's)."""
        P = inp.page_table.shape[1]
        fn = self._compiled_spec(T, S, P, greedy, mode)
        pack = self._spec_packs[S, P]
        results, on_device, self.tcache, self.dcache = fn(*self.state_args, self.tcache, self.dcache, pack.pack(inp),
                                                          pack.device(inp), self.sts_temperatures)
        return RoundOutputs(results, *on_device)

    # -- steps ------------------------------------------------------------------------------
    def _prefill(self, chunks):
        return self._commit_first_tokens(chunks, self._dispatch_prefill(chunks), on_complete=self._assign_slot)

    def _dispatch_prefill(self, chunks) -> jax.Array:
        """Dispatch the prefill of prompt chunks; returns the sampled first tokens (not yet read)."""
        T, S, batch, samp = self._prefill_inputs(chunks)
        fn = self._compiled_prefill((T, S, S))
        tokens, self.tcache, self.dcache = fn(*self.state_args, self.tcache, self.dcache, batch, samp)
        return tokens

    def _commit_first_tokens(self, chunks, tokens, on_complete=None):
        """Commit a prefill's first tokens; a request done at its first token (EOS, max_new_tokens
        1) gives its slot back (rows a round already dispatched for it are ignored when read)."""
        events = self._commit_prefill(chunks, tokens, on_complete=on_complete)
        for r, _ in events:
            if r.status is Status.FINISHED:
                self._slot_of.pop(r.id, None)
        return events

    def _prefill_step(self, chunks):
        """With overlap_admissions and a round in flight: dispatch the prefill behind it (the
        donated caches order them on the device), then the next round, for the running requests
        (fed by the in-flight round) and those this prefill completes (fed by its sampled first
        tokens, joined on the device), and only then read the round and the first tokens."""
        prev = self._inflight
        if not self.overlap_admissions or prev is None:
            return super()._prefill_step(chunks)
        first = self._dispatch_prefill(chunks)
        first.copy_to_host_async()
        joining = {}  # request -> its prefill row, for requests whose prompt this chunk completes
        for i, (r, n) in enumerate(chunks):
            if r.num_cached + n == len(r.prompt_ids):
                self._assign_slot(r)
                joining[id(r)] = i
        reqs = self.scheduler.decode_batch() + [r for r, _ in chunks if id(r) in joining]
        self._inflight = self._dispatch_round(reqs, prev, joined=(first, joining)) if reqs else None
        events = self._read(prev)
        return events + self._commit_first_tokens(chunks, first)

    def _assign_slot(self, r):
        used = set(self._slot_of.values())
        slot = next(i for i in range(self.ec.max_running_requests) if i not in used)
        self._slot_of[r.id] = slot
        self._gen_counter += 1
        self._slot_gen[slot] = self._gen_counter

    def _decode(self, reqs):
        """One speculative round for the running batch (see the module doc for the overlap)."""
        prev = self._inflight
        if self.overlap and prev is not None:
            self._inflight = self._dispatch_round(reqs, prev)
            return self._read(prev)
        events = self._drain()
        reqs = [r for r in reqs if r.status is not Status.FINISHED]
        if reqs:
            self._inflight = self._dispatch_round(reqs, None)
            if not self.overlap:
                events += self._drain()
        return events

    def _dispatch_round(self, reqs, prev: _Round | None, joined=None) -> _Round:
        """Dispatch a round; prev: the in-flight (unread) round, whose device outputs feed the
        anchors and positions of the requests it holds (None, and for any other request: the
        host's committed state, which is current because no unread round holds them).
        joined: (first tokens, {id(request): prefill row}) of an unread prefill: those requests
        start from its tokens, joined into the feed on the device (_prefill_step)."""
        G, bs = self.gamma, len(reqs)
        batch = tuple(reqs)  # a slot and its generation stay fixed while a request runs
        if self._batch_slots is None or self._batch_slots[0] != batch:
            slots = np.array([self._slot_of[r.id] for r in reqs], np.int64)
            self._batch_slots = (batch, slots, self._slot_gen[slots].copy())
        _, slots, generations = self._batch_slots
        step, self._step = self._step, self._step + self.rounds
        budgets, predictions, table_times = [], [], []
        if self._prices_verify_all:  # every round of the call verifies all at one price: priced once
            decision = self.scheduler_conf.verify_all(bs, overlapped=prev is not None)
            budgets = [decision.budget] * self.rounds
            predictions, table_times = [decision.predicted_step_seconds], [decision.table_step_seconds] * self.rounds
        else:
            for j in range(self.rounds):
                if self.spec.mode != "static" and self.spec.forced_budget is not None:  # profiling (profile_sps.py)
                    K = min(int(self.spec.forced_budget), bs * G)
                    if self.spec.cost_table is not None:
                        predictions.append(self.spec.cost_table.predict(bs, K))
                        table_times.append(predictions[-1])
                elif self._schedules:
                    decision = self.scheduler_conf.decide_lagged(step + j, generations, slots,
                                                                 overlapped=prev is not None)
                    K = decision.budget
                    predictions.append(decision.predicted_step_seconds)
                    table_times.append(decision.table_step_seconds)
                else:  # static, or compact without a cost table: verify everything
                    K = bs * G
                budgets.append(K)
        predicted = sum(predictions) / len(predictions) if predictions else None  # (np.mean: 15 us a round)
        # One tier for the call's rounds: the largest any of them needs.
        mode = self._round_mode()
        if self._schedules:
            # The tier's padding tokens cost what verified ones would: every round of the call
            # verifies up to the tier's capacity, the next drafts by current survival (still a
            # top-K, with K a function of host scalars only).  Cap-accept caps its commits there
            # too, as compact would.  Those rounds are priced as they run, at the filled budget.
            fill = min(self.tiers.tier_for(bs, max(budgets)) - bs, bs * G)
            budgets = [fill] * self.rounds
            seconds, table_seconds = self.scheduler_conf.price(bs, fill, overlapped=prev is not None)
            predicted, table_times = seconds, [table_seconds] * self.rounds
        T = self.tiers.tier_for(bs, max(budgets)) if mode == "compact" else self.tiers.round_up(bs * (G + 1))
        S = min(T, self.ec.max_running_requests)
        live, table, temp, top_k, top_p, seed = self._round_inputs(reqs, S)
        fed_index = np.full(S, -1, np.int32)
        if prev is not None and prev.reqs == reqs:  # the same batch as the round in flight: fed row by row
            fed_index[:bs] = np.arange(bs, dtype=np.int32)
        elif prev is not None:
            prev_row = {id(r): i for i, r in enumerate(prev.reqs)}
            fed_index[:bs] = [prev_row.get(id(r), -1) for r in reqs]
        fed = (prev.out.next_anchor, prev.out.next_start) if prev is not None else self._no_feed
        if joined is not None:
            fed = self._join(fed, fed_index, reqs, *joined)
        anchor, start = np.zeros(S, np.int32), np.zeros(S, np.int32)
        host = np.flatnonzero(fed_index[:bs] < 0)
        if host.size:  # requests no unread round holds start from the host's committed state
            anchor[host] = [reqs[i].output_ids[-1] for i in host]
            start[host] = [reqs[i].total_len - 1 for i in host]
        probes = np.full((S, G + 1, self._num_probes), -1, np.int32)
        if self.estimator is not None:  # never overlapped: the host state is current
            probes[:bs] = self.estimator.probe_tokens([r.id for r in reqs], start[:bs], G + 1)
        inp = SpecInputs(anchor, start, table, live, np.int32(bs), np.asarray(budgets, np.int32), temp, top_k, top_p,
                         seed, *fed, fed_index, probes)
        greedy = self.spec.greedy_rounds and not temp[:bs].any()  # the greedy round variant
        self._compiled_spec(T, S, table.shape[1], greedy, mode)  # compiled before the clock starts (precompile off)
        t0 = time.perf_counter()
        out = self._run_round(T, S, inp, greedy, mode)
        for x in jax.tree.leaves((out.results, out.estimate)):  # what _read needs; the fed arrays stay on device
            x.copy_to_host_async()
        return _Round(reqs, out, S, slots, generations, step, budgets, T, predicted, table_times, t0, prev is not None)

    def _join(self, fed, fed_index, reqs, first_tokens, joining):
        """Point the joining requests' rows at free rows of the feed (rows no fed request reads)
        and write their first tokens and positions there, on the device."""
        R = self.ec.max_running_requests
        free = iter(sorted(set(range(R)) - set(fed_index[fed_index >= 0].tolist())))
        joins = np.zeros((3, self.prefill_seqs), np.int32)
        joins[0] = R  # no destination: dropped
        j = 0
        for i, r in enumerate(reqs):
            if id(r) in joining:
                fed_index[i] = row = next(free)
                joins[:, j] = (row, joining[id(r)], len(r.prompt_ids))
                j += 1
        return self._join_feed(*fed, first_tokens, joins)

    def _read(self, rnd: _Round):
        """Read a dispatched call (the one host sync per call) and commit its rounds in order."""
        buf, estimate = jax.device_get((rnd.out.results, rnd.out.estimate))
        stacked = self._result_packs[rnd.rows].unpack_host(buf)
        now = time.perf_counter()
        # The call's cost as the engine sees it: from its dispatch or the previous read, whichever
        # came later, to this read, shared by its rounds.  Overlapped, that is the period between
        # reads (device time or host time, whichever bounds the loop); otherwise dispatch-to-read.
        # The cost table is profiled on this same quantity (benchmarks/profile_sps.py), so
        # predictions compare to it.
        # A shape compiled on first use inside that span (the next round's, dispatched while this
        # one ran) is host time no round costs in serving: it is left out (it once put an 11 s
        # "round" into a benchmark's predicted-vs-measured sums).
        start = max(rnd.dispatched_at, self._last_read_at)
        compiling = sum(max(0.0, min(b, now) - max(a, start)) for a, b in self._compiles_since_read)
        self._compiles_since_read.clear()
        measured = max(now - start - compiling, 1e-9) / self.rounds
        self._last_read_at = now
        if rnd.predicted_s is not None:  # predicted vs measured step time, for checking the cost table
            st, n, bs = self.stats, self.rounds, len(rnd.reqs)
            st["predicted_step_s"].extend([rnd.predicted_s] * n)
            st["table_step_s"].extend(rnd.table_s)
            st["measured_step_s"].extend([measured] * n)
            if self.spec.forced_budget is None:  # the level correction learns from every read round
                for budget in rnd.budgets:
                    self.scheduler_conf.record_step_time(bs, budget, measured, overlapped=rnd.overlapped)
        events = []
        for j in range(self.rounds):
            out = SpecOutputs(*(getattr(stacked, f)[j] for f in ROUND_RESULT_FIELDS), None, None, estimate)
            events += self._commit_round(rnd, j, out, measured)
        return events

    def _commit_round(self, rnd: _Round, j: int, out: SpecOutputs, measured: float):
        """Round j of a read call: statistics, calibration and scheduler records, then the commit."""
        G, bs, budget = self.gamma, len(rnd.reqs), rnd.budgets[j]
        # (batch size, budget K, tier, tokens verified, seconds, overlapped) per round, for profiling.
        self.stats["round_log"].append((bs, budget, rnd.tier, int(out.verify_lens[:bs].sum()), measured, rnd.overlapped))
        # Rows of requests that finished in an earlier round ran past their end: keep them out of
        # the calibration data (the scheduler's lag ring drops them by slot generation).
        alive = np.array([r.status is not Status.FINISHED for r in rnd.reqs])
        if self.confidence_metrics is not None:
            labels = np.arange(G)[None, :] < out.block_accept[:bs, None]
            self.confidence_metrics.update(out.survival[:bs][alive], labels[alive])
        if self._schedules:
            self.scheduler_conf.observe(rnd.step + j, out.survival[:bs], rnd.generations, slots=rnd.slots)
        self.stats["rounds"] += 1
        done = commit_rounds(self.stats, rnd.reqs, out.drafts, out.num_accepted, out.bonus, out.verify_lens,
                             out.block_accept)
        events = [(r, committed) for r, _, committed in done]
        starts = [start for _, start, _ in done]
        commits = [committed for *_, committed in done]
        for r, _ in events:
            if r.status is Status.FINISHED:
                self._slot_of.pop(r.id, None)
        if rnd.predicted_s is not None:
            self.stats["round_context"].append((sum(map(len, commits)), rnd.overlapped, bs, budget))
        if self._recorder is not None:  # after the commit: a row knows whether its request ended here
            final = np.array([r.status is Status.FINISHED for r in rnd.reqs])[alive]
            self._recorder.add(out.confidence_logits[:bs][alive], out.block_accept[:bs][alive], final)
        if self.estimator is not None:
            self._update_estimator(rnd.reqs, out, starts, commits)
        return events

    def _update_estimator(self, reqs, out: SpecOutputs, starts, commits) -> None:
        """Fold a (never overlapped, so every row is live) round into the block-accept estimator."""
        bs, est = len(reqs), out.estimate
        eligible = [r.params.temperature > 0 and (r.params.top_k or 0) <= 0 and (r.params.top_p or 1.0) >= 1.0
                    for r in reqs]
        self.estimator.update([r.id for r in reqs], starts, out.verify_lens[:bs] - 1, out.num_accepted[:bs],
                              out.drafts[:bs], est.draft_logq[:bs], est.probe_logp[:bs], est.next_draft_logp[:bs],
                              commits, eligible)
        for r in reqs:
            if r.status is Status.FINISHED:
                reason = {"stop": "eos", "length": "length"}.get(r.finish_reason, "abort")
                r.spec_extra["ceiling_estimate"] = self.estimator.finish(r.id, reason)

    def set_record_group(self, name: str) -> None:
        """Tag the STS rows recorded from now on with a group name (no-op when not recording)."""
        if self._recorder is not None:
            self._recorder.set_group(name)

    def flush_records(self):
        """Write any buffered STS calibration rows to a shard (no-op when not recording)."""
        return self._recorder.flush() if self._recorder is not None else None

    def summary(self) -> dict:
        """Aggregate speculative statistics since start-up (engine-level observability)."""
        st = self.stats
        out = {"mode": self.spec.mode, **summarize_rounds(st, self.gamma)}
        if st["predicted_step_s"]:
            pred, meas = np.asarray(st["predicted_step_s"]), np.asarray(st["measured_step_s"])
            table = np.asarray(st["table_step_s"])
            out["step_time"] = {"predicted_mean_s": float(pred.mean()), "measured_mean_s": float(meas.mean()),
                                "median_relative_error": float(np.median(np.abs(pred - meas) / meas)),
                                "table_mean_s": float(table.mean()),  # the raw table, without the level correction
                                "table_median_relative_error": float(np.median(np.abs(table - meas) / meas))}
        if self.confidence_metrics is not None and st["accept_lens"]:
            out["confidence"] = self.confidence_metrics.summary()
        if self.estimator is not None:
            out["ceiling_estimate"] = self.estimator.summary()
        return out

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self._slot_of.pop(request_id, None)
        if self.estimator is not None:
            self.estimator.finish(request_id, "abort")
