"""Engine: the Python entry point for batch generation, plain or speculative.

    engine = Engine.from_pretrained("path/to/qwen3")
    engine = Engine.from_pretrained("path/to/qwen3", spec=SpeculativeConfig(mode="compact"),
                                    draft_path="path/to/dspark-drafter")
    results = engine.generate(["Hello"], SamplingParams(max_new_tokens=32))

One loop for every algorithm: requests are admitted as slots and KV pages free up (continuous
batching), prompts are prefilled in chunks, and every running request advances by a decode step
or a speculative round, which a worker (engine/worker.py) compiles and runs.  With overlap the
next step is dispatched, fed on the device, before the last one is read: reading committed
tokens back is the only time the host waits for the device.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from pathlib import Path

import jax
import numpy as np

from dspark_jax.checkpoint import load_model
from dspark_jax.config import Qwen3Config
from dspark_jax.engine.admission import check_params, encode_prompt
from dspark_jax.engine.background_compile import BackgroundCompiles, ExecutablePending
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.model_runner import ModelRunner, batch_ladder, enable_compilation_cache, round_up
from dspark_jax.engine.request import GenerationResult, Request, Status
from dspark_jax.engine.scheduler import Scheduler
from dspark_jax.engine.startup import compile_engines, make_worker, queue_in_background, startup_executables
from dspark_jax.engine.worker import PlainWorker, Worker
from dspark_jax.errors import InvalidRequestError
from dspark_jax.grammar.compile import GrammarCompiler
from dspark_jax.kv_cache import allocate_kv_cache, kv_bytes_per_token
from dspark_jax.layers.layer_split import split_layers, worth_splitting
from dspark_jax.logit_processors import CONSTRAINED, LogitProcessors
from dspark_jax.models.qwen3 import Qwen3ForCausalLM
from dspark_jax.page_pool import PagePool
from dspark_jax.parallel.host import to_host
from dspark_jax.parallel.runtime import Parallel
from dspark_jax.sampling import SamplingParams
from dspark_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: Qwen3ForCausalLM, tokenizer: Tokenizer | None, config: EngineConfig | None = None, *,
                 drafter=None, spec=None, worker: Worker | None = None, devices=None):
        """drafter: a DSparkDrafter or MTPDrafter beside the target (spec: its SpeculativeConfig);
        worker: an already built worker instead; devices: the ec.tp_size devices this engine runs
        on (default: the first tp_size devices)."""
        self.ec = ec = config or EngineConfig()
        ec.validate()
        self.parallel = Parallel(ec.tp_size, devices)
        self.parallel.check(model.config, "target")
        self.worker = worker or make_worker(drafter, spec)
        self.config: Qwen3Config = model.config
        self.tokenizer = tokenizer
        self.max_model_len = min(ec.max_model_len or 4096, self.config.max_position_embeddings)
        self.pages_per_seq = -(-self.max_model_len // ec.page_size)
        # page-table widths of decode steps and rounds, ascending, the last one pages_per_seq
        self.page_widths = (batch_ladder(self.pages_per_seq, start=max(1, -(-ec.min_context_bucket // ec.page_size)))
                            if ec.min_context_bucket else [self.pages_per_seq])
        unroll = ec.unroll_decode if ec.unroll_decode is not None else jax.default_backend() == "gpu"
        par = self.parallel
        if unroll and par.default and worth_splitting(model.layers):  # before the pool takes the memory
            split_layers(model.layers)
        self.pool = PagePool(ec.num_pages or self._default_num_pages(model), ec.page_size)
        enable_compilation_cache(ec.compile_cache_dir)
        cache = (allocate_kv_cache(self.config, self.pool.num_pages, ec.page_size, model.dtype) if par.default else
                 par.allocate_kv(self.config.num_hidden_layers, self.pool.num_pages, ec.page_size,
                                 self.config.num_key_value_heads, self.config.head_dim, model.dtype))
        self.runner = ModelRunner(model, cache, kernels=ec.kernels, unroll=unroll, parallel=par)
        self.num_tokens = model.num_tokens  # the real vocabulary (the head may be wider)
        # Under tensor parallelism the processor state is replicated, as the gathered logits are.
        self.processors = None if ec.logit_processors == "off" else LogitProcessors(
            self.runner, slots=ec.max_running_requests, vocab=par.vocab_width(self.config.vocab_size),
            max_len=self.max_model_len, precompile=ec.logit_processors == "precompile", grammar_rows=ec.grammar_states)
        # (one process decides alone what runs padded: hosts that must step alike compile it all)
        widest_first = ec.widest_first if ec.widest_first is not None else self.runner.platform == "gpu"
        self.widest_first = widest_first and jax.process_count() == 1
        # lazily compiled processed and constrained executables, and those a start-up leaves for
        # later, build beside the running batch
        lazy = self.processors is not None and not self.processors.precompile
        self.background = (BackgroundCompiles(lambda lowered: self.runner.compile(lowered, stalls=False))
                           if lazy or self.widest_first else None)
        self.prefill_seqs = min(ec.max_prefill_seqs, ec.max_running_requests)
        self.decode_buckets = batch_ladder(ec.max_running_requests)
        self.prefill_buckets = batch_ladder(ec.max_prefill_tokens, start=min(16, ec.max_prefill_tokens))
        self.scheduler = Scheduler(self.pool, max_running=ec.max_running_requests,
                                   max_prefill_tokens=ec.max_prefill_tokens, max_prefill_seqs=self.prefill_seqs)
        self.eos_ids = frozenset(self.config.eos_token_ids) | frozenset(tokenizer.eos_token_ids if tokenizer else ())
        self.grammars = None if self.processors is None else GrammarCompiler(
            tokenizer, self.eos_ids, self.processors.vocab, max_states=self.processors.grammar.rows)
        self.scheduler.gate = self._acquire_grammar
        self._rng = np.random.default_rng(ec.seed)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._inflight = None  # a dispatched, unread step
        self.worker.bind(self)
        self.overlap = ec.overlap and self.worker.overlaps
        self.compile_seconds = 0.0
        if ec.precompile:  # (a lazily compiled engine calibrates on its first step)
            self.prepare()

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None, spec=None, *,
                        draft_path: str | Path | None = None, devices=None, **overrides) -> Engine:
        """A Hugging Face Qwen3 folder, and with ``draft_path`` a drafter folder (DSpark or MTP,
        as ``spec.algorithm`` says; a DSpark drafter's own sts.json calibrates its confidences
        unless ``spec.sts`` is given or STS data is being recorded)."""
        ec = dataclasses.replace(config or EngineConfig(), **overrides)
        dtype = ec.dtype or ("float32" if jax.default_backend() == "cpu" else None)
        if ec.tp_size > 1:  # each device reads its own blocks: no whole copy on one device
            from dspark_jax.parallel.loading import load_sharded

            par = Parallel(ec.tp_size, devices)
            tcfg, model = load_sharded(path, par, dtype=dtype)
            devices = par.devices
        else:
            tcfg, model = load_model(path, dtype=dtype)
        drafter = None
        if draft_path is not None:
            from dspark_jax.spec.loading import load_drafter_for

            drafter, spec = load_drafter_for(tcfg, model, draft_path, spec)
        elif spec is not None:
            raise ValueError("a speculative config needs draft_path")
        return cls(model, Tokenizer.from_folder(path), ec, drafter=drafter, spec=spec, devices=devices)

    def prepare(self, progress=None) -> None:
        """Start-up: read a cached cost table first (it may rule the speculative steps out before
        any of them compiles), compile the executables the worker then runs (progress: as in
        compile_engines; startup.startup_executables says which before serving), then let the
        worker measure this device."""
        self.calibrate(compile=False, cached_only=True)
        worker, profiles = self.worker, getattr(self.worker, "needs_calibration", False)
        self.compile_seconds = compile_engines([self], progress, widest_first=True)
        self.calibrate(compile=True)
        if profiles and self.worker is worker and self.widest_first:  # what the profile did not run
            queue_in_background(self, startup_executables(self)[1])

    def calibrate(self, compile: bool | None = None, cached_only: bool = False) -> None:
        """Let the worker measure this device once its executables exist (a DSpark engine asked to
        derive its cost table profiles its rounds in this loop).  When the measured table says no
        speculative round can beat a plain decode step at any batch size, even with every draft
        accepted, the engine drops the drafter and runs plain decode steps: the same tokens,
        without paying for drafts that cannot pay for themselves.  compile: build the plain
        steps then (default: as the engine's precompile says).  cached_only: before compiling,
        decide from a table an earlier start-up cached, if any (a warm start that serves plain
        steps then never builds the speculative executables)."""
        self.worker.calibrate(cached_only)
        pays = getattr(self.worker, "speculation_pays", None)
        if pays is None or pays():  # (several hosts share rank 0's table, so they all decide alike)
            return
        log.info("the measured cost table says no speculative round beats a plain decode step on this device: "
                 "serving plain decode steps")
        self.settle()
        self.worker.release_device_memory()
        self.worker = PlainWorker()
        self.worker.bind(self)
        self.overlap = self.ec.overlap and self.worker.overlaps
        if self.ec.precompile if compile is None else compile:
            self.compile_seconds += self.compile_all()

    # -- sizing and compilation --------------------------------------------------------------
    def _default_num_pages(self, model) -> int:
        want = self.ec.max_running_requests * self.pages_per_seq + 1
        stats = self.parallel.device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return want
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        per_token = kv_bytes_per_token(self.config, model.dtype) + self.worker.kv_bytes_per_token(model.dtype)
        per_token = max(1, int(per_token * self.parallel.kv_bytes_fraction(self.config.num_key_value_heads)))
        fit = int(free * self.ec.kv_memory_fraction) // (per_token * self.ec.page_size)
        return max(2, min(want, fit))

    def executables(self) -> list:
        """(label, compile thunk) of every executable compiled at start-up."""
        return self.worker.executables() + (self.processors.executables() if self.processors else [])

    def compile_all(self) -> float:
        """Compile the executables the worker runs as a start-up does (startup_executables);
        returns seconds spent."""
        return compile_engines([self], widest_first=True)

    def page_width(self, tokens: int) -> int:
        """The page-table width of a step whose requests touch at most `tokens` positions each:
        the smallest context bucket that holds them."""
        return round_up(-(-int(tokens) // self.pool.page_size), self.page_widths)

    @property
    def lookahead(self) -> int:
        return self.worker.lookahead

    @property
    def stats(self) -> dict | None:
        """The worker's round statistics (speculative workers), else None."""
        return self.worker.stats

    def summary(self) -> dict:
        """Aggregate speculative statistics since start-up (empty for plain decoding)."""
        return self.worker.summary()

    # -- requests ------------------------------------------------------------------------------
    def encode_prompt(self, prompt) -> list[int]:
        """Token ids of a prompt (text or ids), checked against the vocabulary and the context."""
        return encode_prompt(prompt, self.tokenizer, self.config.vocab_size, self.max_model_len, self.lookahead)

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        """A validated copy of a request's sampling parameters (default ones for None), checked
        against this engine: the vocabulary, and whether it runs logit processors."""
        return check_params(params, self.num_tokens, self.processors, self.grammars, self.eos_ids)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        req = self.make_request(prompt, params, request_id)
        if req.id in self._requests:
            raise InvalidRequestError(f"duplicate request id {req.id!r}")
        self._requests[req.id] = req
        self.scheduler.add(req)
        return req.id

    def make_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        """A checked request for this engine, not queued (its seed drawn now unless params has
        one): what add_request queues, and what a front for replicas on other hosts keeps as
        its stand-in (parallel/host_replicas.py)."""
        params = self.check_params(params)
        ids = self.encode_prompt(prompt)
        rid = request_id or f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
        req = Request(rid, ids, params, seed, self.tokenizer, self.eos_ids, self.max_model_len, self.lookahead)
        if self.pool.pages_for(req.reserve_tokens) > self.pool.num_usable_pages:
            raise InvalidRequestError(
                f"request needs {req.reserve_tokens} KV slots but the whole pool holds {self.pool.capacity_tokens}")
        return req

    def get_request(self, request_id: str) -> Request | None:
        """The live (queued or running) request with this id, or None once it is released."""
        return self._requests.get(request_id)

    def abort(self, request_id: str) -> None:
        """Finish a request with reason "abort" and forget it: its slot and KV pages go back now
        (a waiting one held none), and its id may be used again."""
        self.scheduler.abort(request_id)
        self._release_finished()
        self._requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def set_max_running(self, n: int) -> None:
        """Admit at most ``n`` running requests from now on (1..max_running_requests); those
        already running are left alone.  Every shape stays compiled for the configured maximum."""
        n = int(n)
        if not 1 <= n <= self.ec.max_running_requests:
            raise ValueError(f"max running must be in [1, {self.ec.max_running_requests}], got {n}")
        self.scheduler.max_running = n

    def compiled(self, cache: dict, key, lower, *, optional: bool = False):
        """A worker's executable for key, lowered and compiled on first use.  optional: only
        requests with logit processors or a grammar need it; where those compile lazily it builds
        in the background and ExecutablePending is raised until it is ready, as it is for an
        executable the start-up queued there."""
        if key not in cache:
            bg = self.background
            if bg is not None and (optional or bg.takes(cache, key)):
                return bg.get(cache, key, lower)
            cache[key] = self.runner.compile(lower())
        return cache[key]

    # -- stepping ------------------------------------------------------------------------------
    def step(self) -> list[tuple[Request, list[int]]]:
        """Run one scheduling step; returns (request, newly committed ids) for requests that moved.
        Finished requests are released (slot and KV pages) before returning."""
        if getattr(self.worker, "needs_calibration", False):  # lazily compiled: before the first request
            self.calibrate()
        self.scheduler.admit()
        chunks = self.scheduler.next_prefill()
        events = self._drain() if chunks else []
        prefilled = self._prefill(chunks) if chunks else None
        if prefilled is not None:
            events += prefilled
        else:  # nothing to prefill, or every chunk waits on a background compile
            reqs = self.scheduler.decode_batch()
            events += self._decode(reqs) if reqs else self._drain()
        self._release_finished()
        return events

    def _acquire_grammar(self, req: Request) -> bool:
        """Admission's check of a request's grammar rows (reserved now; False: no room yet)."""
        if req.grammar is None:
            return True
        req.grammar_row = self.processors.grammar.acquire(req.grammar)
        return req.grammar_row is not None

    def _prefill(self, chunks):
        """Prefill prompt chunks; a request whose prompt is now cached starts decoding with its
        sampled first token.  Chunks of grammar requests whose executable is still compiling
        wait (None: every chunk waits, and nothing was read)."""
        if self.processors is not None:  # a request's processors before its first token (again if it waits)
            for r, _ in chunks:
                if r.num_cached == 0 and r.params.processes_logits:
                    self.processors.install(r)
        try:
            out = self.worker.prefill(chunks)
        except ExecutablePending:
            chunks = [(r, n) for r, n in chunks if r.grammar is None]
            if not chunks:
                return None
            out = self.worker.prefill(chunks)
        events = []
        tokens, logprobs = out
        tokens = to_host(tokens).tolist()
        # (each read is a device-to-host copy the loop waits on: logprobs only where a request asks)
        wanted = logprobs is not None and any(r.logprobs is not None for r, _ in chunks)
        logprobs = jax.tree.map(to_host, logprobs) if wanted else None
        for i, (r, n) in enumerate(chunks):
            r.num_cached += n
            if r.num_cached == len(r.prompt_ids):
                r.status = Status.DECODE
                lp = None if logprobs is None else type(logprobs)(*(x[i: i + 1] for x in logprobs))
                events.append((r, r.append_tokens([tokens[i]], lp)))
        return events

    def _decode(self, reqs):
        """A decode step or round for every running request, overlapped with reading the last
        one when the worker can feed it on the device."""
        prev = self._inflight
        if self.overlap and prev is not None:
            call = self._dispatch(reqs, prev)
            if call is not None:
                self._inflight = call
                return self.worker.read(prev)
        events = self._drain()
        reqs = [r for r in reqs if r.status is not Status.FINISHED]
        if reqs:
            call = self._dispatch(reqs, None)
            if call is None:  # every request waits on a background compile: let it run
                self.background.wait(0.05)
            else:
                self._inflight = call
                if not self.overlap:
                    events += self._drain()
        return events

    def _dispatch(self, reqs, prev):
        """Dispatch reqs (fed by prev, if given and the worker can); while the executable they
        need compiles in the background, dispatch those of them that need less: requests with a
        grammar, then those with logit processors, sit the step out.  None: nothing dispatched."""
        for below in (None, CONSTRAINED, True):
            batch = reqs if below is None else [r for r in reqs if LogitProcessors.level([r]) < below]
            if batch and (prev is None or self.worker.feeds(prev, batch)):
                try:
                    return self.worker.dispatch(batch, prev)
                except ExecutablePending:
                    pass
        return None

    def settle(self) -> None:
        """Read the step in flight, if any, and release what finished: nothing is left running on
        the device for requests that are gone."""
        self._drain()
        self._release_finished()

    def _drain(self):
        if self._inflight is None:
            return []
        inflight, self._inflight = self._inflight, None
        return self.worker.read(inflight)

    def _release_finished(self) -> None:
        for req in self.scheduler.release_finished():
            self.worker.release(req)
            if req.grammar_row is not None:
                self.processors.grammar.release(req.grammar)
                req.grammar_row = None
            self._requests.pop(req.id, None)

    # -- batch API -----------------------------------------------------------------------------
    def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        """Generate for every prompt (a string or a list of token ids); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("need one SamplingParams per prompt")
        # Validate everything before queueing anything, so one bad prompt harms no other.
        for p, sp in zip(prompts, params):
            self.encode_prompt(p)
            self.check_params(sp)
        reqs = [self._requests[self.add_request(p, sp)] for p, sp in zip(prompts, params)]
        t0 = time.perf_counter()
        while any(r.status is not Status.FINISHED for r in reqs):
            self.step()
        # An overlapped loop dispatched one step ahead for requests that turned out finished:
        # settle it, so its time and statistics do not spill into the next call.
        self.settle()
        wall = time.perf_counter() - t0
        n = sum(len(r.output_ids) for r in reqs)
        self.last_generate_stats = {"wall_s": wall, "completion_tokens": n, "tokens_per_s": n / wall if wall else None}
        return [r.result() for r in reqs]
