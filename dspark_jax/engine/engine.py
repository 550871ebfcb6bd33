"""Engine: the Python entry point for batch generation.

    engine = Engine.from_pretrained("path/to/qwen3")
    results = engine.generate(["Hello"], SamplingParams(max_new_tokens=32))

Requests run in slots (continuous batching): new requests are admitted as soon as a slot and
their KV pages are free.  Each step is one compiled executable; the host blocks only to read
the sampled token ids back.
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
from dspark_jax.engine.model_runner import ModelRunner, batch_ladder, enable_compilation_cache, round_up
from dspark_jax.engine.request import GenerationResult, Request, Status
from dspark_jax.engine.scheduler import Scheduler
from dspark_jax.errors import InvalidRequestError
from dspark_jax.forward_batch import build_forward_batch
from dspark_jax.kv_cache import allocate_kv_cache, kv_bytes_per_token
from dspark_jax.layers.attention import resolve_backend
from dspark_jax.models.qwen3 import Qwen3ForCausalLM
from dspark_jax.page_pool import PagePool
from dspark_jax.sampling import SamplingParams, sampling_arrays
from dspark_jax.tokenizer import Tokenizer
from pallas_kernels.fused_add_rms_norm import resolve_backend as resolve_norm_backend
from pallas_kernels.kv_write import resolve_backend as resolve_kv_write_backend

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineConfig:
    max_running_requests: int = 16
    max_model_len: int | None = None  # default: min(max_position_embeddings, 4096)
    page_size: int = 16
    num_pages: int | None = None  # default: every slot can hold max_model_len, within memory
    kv_memory_fraction: float = 0.85  # of free device memory, when the device reports it
    max_prefill_tokens: int = 512
    max_prefill_seqs: int = 8
    attention_backend: str = "auto"  # auto | pallas | reference
    # residual add + RMSNorm in the plain engine's steps: reference (plain jnp, left to XLA) |
    # pallas (the fused kernel, reading each layer's weight row in place) | auto (pallas on GPU).
    # q / k norm + rope + K/V cache write: reference (XLA) | pallas (one kernel from the qkv
    # projection, pallas_kernels/kv_write) | auto.  Both kernels together against XLA, 8B-shaped
    # decode step on the H200: 4.60 vs 4.94 ms at batch 1, 4.76 vs 4.96 at 16, 6.04 vs 6.28 at
    # 64 (benchmarks/results/decode_qwen3-8b_gpu_*_{69bf0e8,53d9908}.md); hence auto.
    norm_backend: str = "auto"
    kv_write_backend: str = "auto"
    # unroll every loop of the decode and speculative steps (layers, drafting steps); default: on
    # GPU only, where an XLA while loop is driven from the host iteration by iteration.  Batch-1
    # speculative rounds on the H200: 4-23% more tok/s, but ~4x the compile time at start-up
    # (benchmarks/results/speculative_default_gpu_bs1_*_8042ee7.md).
    unroll_decode: bool | None = None
    dtype: str | None = None  # default: float32 on CPU (bf16 math is slow there), else the checkpoint's
    # Context buckets of the decode and round executables: a step's page table is as wide as the
    # smallest bucket that holds its longest request, the buckets doubling from this many tokens
    # up to max_model_len (0: one bucket, max_model_len).  The attention kernel's launch geometry
    # (KV splits, the short verify's q tile) is a function of static shapes, and the table's
    # width is the only static bound it has on the live context: with one max_model_len-wide
    # table a 32k engine would split and tile a 2k context as if it held 32k.  Each bucket is one
    # more compiled executable per decode batch size / round tier (none below this length).
    min_context_bucket: int = 8192
    # Compile each decode bucket twice, for all-greedy batches (argmax only, no sort) and for
    # batches that sample, the host picking per step, instead of once with a device-side choice
    # (sampling.sample's lax.cond).  On the GPU XLA's conditional copies its predicate to the host
    # and waits for the device to reach it, so the host blocks inside every decode step and the
    # overlap of step t+1's dispatch with step t cannot hide the host's work (the DSpark
    # engine's rounds have their own switch, SpeculativeConfig.greedy_rounds).  On by default
    # since measured: batch-1 8B decode step 4.32 vs 4.78 ms with the device-side choice, 1.19
    # vs 1.32x the HBM floor, end-to-end / device 0.85 vs 0.74 (batch 16 unchanged;
    # benchmarks/results/decode_qwen3-8b_gpu_bs1-16{,_sampvar}_5816917.md).  The cost: twice the
    # decode executables to compile at start-up.
    sampling_variants: bool = True
    compile_cache_dir: str | None = None
    precompile: bool = True  # False: compile each shape bucket on first use
    overlap: bool = True  # dispatch decode step t+1 (fed on device by step t) before reading step t
    # Admit waiting requests only when this many slots are free (or all of them fit), at most
    # admit_max_wait steps late: each admission drains the overlapped loop, so several per drain
    # cost less (engine/scheduler.py).  1: admit as soon as a slot frees (not yet measured otherwise).
    admit_batch: int = 1
    admit_max_wait: int = 8
    seed: int = 0  # draws seeds for requests that do not bring one


class Engine:
    def __init__(self, model: Qwen3ForCausalLM, tokenizer: Tokenizer | None, config: EngineConfig | None = None):
        self.ec = ec = config or EngineConfig()
        self.config: Qwen3Config = model.config
        self.tokenizer = tokenizer
        self.max_model_len = min(ec.max_model_len or 4096, self.config.max_position_embeddings)
        if ec.max_running_requests < 1 or ec.max_prefill_tokens < 1:
            raise ValueError("max_running_requests and max_prefill_tokens must be >= 1")
        self.pages_per_seq = -(-self.max_model_len // ec.page_size)
        if ec.min_context_bucket < 0:
            raise ValueError(f"min_context_bucket must be >= 0, got {ec.min_context_bucket}")
        # page-table widths of decode steps and rounds, ascending, the last one pages_per_seq
        self.page_widths = (batch_ladder(self.pages_per_seq, start=max(1, -(-ec.min_context_bucket // ec.page_size)))
                            if ec.min_context_bucket else [self.pages_per_seq])
        num_pages = ec.num_pages or self._default_num_pages(model)
        self.pool = PagePool(num_pages, ec.page_size)
        cache = allocate_kv_cache(self.config, num_pages, ec.page_size, model.dtype)
        self.backend = resolve_backend(ec.attention_backend)
        # what the norm / K/V-write settings resolve to here (auto: pallas on GPU), for reports
        self.norm_backend = resolve_norm_backend(ec.norm_backend, self.config.hidden_size)
        self.kv_write_backend = resolve_kv_write_backend(ec.kv_write_backend, self.config.head_dim)
        enable_compilation_cache(ec.compile_cache_dir)
        unroll = ec.unroll_decode if ec.unroll_decode is not None else jax.default_backend() == "gpu"
        self.unroll_decode = bool(unroll)
        self.runner = ModelRunner(
            model, cache, backend=self.backend,
            unroll_decode=unroll, lazy=not ec.precompile, norm_backend=self.norm_backend,
            kv_write_backend=self.kv_write_backend, sampling_variants=ec.sampling_variants,
        )
        self.prefill_seqs = min(ec.max_prefill_seqs, ec.max_running_requests)
        self.decode_buckets = batch_ladder(ec.max_running_requests)
        self.prefill_buckets = batch_ladder(ec.max_prefill_tokens, start=min(16, ec.max_prefill_tokens))
        self.scheduler = Scheduler(
            self.pool,
            max_running=ec.max_running_requests,
            max_prefill_tokens=ec.max_prefill_tokens,
            max_prefill_seqs=self.prefill_seqs,
            admit_batch=ec.admit_batch,
            admit_max_wait=ec.admit_max_wait,
        )
        self.eos_ids = frozenset(self.config.eos_token_ids) | frozenset(tokenizer.eos_token_ids if tokenizer else ())
        self._rng = np.random.default_rng(ec.seed)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._last_round_inputs = None  # _round_inputs' last (key, arrays)
        self.lookahead = 0  # positions past the last token a step may write (speculative blocks)
        self._inflight: tuple[list[Request], jax.Array] | None = None  # a dispatched, unread decode step
        self.compile_seconds = self.runner.compile(self.all_buckets()) if ec.precompile else 0.0

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None, **overrides) -> "Engine":
        ec = dataclasses.replace(config or EngineConfig(), **overrides)
        dtype = ec.dtype or ("float32" if jax.default_backend() == "cpu" else None)
        _, model = load_model(path, dtype=dtype)
        return cls(model, Tokenizer.from_folder(path), ec)

    # -- sizing ---------------------------------------------------------------------------
    def _default_num_pages(self, model) -> int:
        want = self.ec.max_running_requests * self.pages_per_seq + 1
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return want
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        per_page = (kv_bytes_per_token(self.config, model.dtype) + self._extra_kv_bytes_per_token(model)) * self.ec.page_size
        fit = int(free * self.ec.kv_memory_fraction) // per_page
        return max(2, min(want, fit))

    def _extra_kv_bytes_per_token(self, model) -> int:
        """KV bytes per token beyond the target's (a drafter's own cache, sharing page ids)."""
        return 0

    def all_buckets(self) -> list[tuple[int, int, int, int]]:
        """(tokens, sequences, logits rows, page-table width) of every step executable: decode at
        every context bucket, prefill (compute-bound: its grid fills the GPU unsplit) at the full width."""
        decode = [(b, b, b, p) for b in self.decode_buckets for p in self.page_widths]
        prefill = [(t, self.prefill_seqs, self.prefill_seqs, self.pages_per_seq) for t in self.prefill_buckets]
        return sorted(set(decode + prefill))

    def page_width(self, tokens: int) -> int:
        """The page-table width of a decode step or round whose requests touch at most `tokens`
        positions each: the smallest context bucket that holds them."""
        return round_up(-(-int(tokens) // self.pool.page_size), self.page_widths)

    # -- requests -------------------------------------------------------------------------
    def encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise InvalidRequestError("prompt must be a string or a list of integer token ids") from None
        if not ids:
            raise InvalidRequestError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        if len(ids) + self.lookahead >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context is {self.max_model_len}, which must also hold "
                f"at least one generated token{f' and a {self.lookahead}-token draft block' if self.lookahead else ''}"
            )
        return ids

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = dataclasses.replace(params) if params else SamplingParams()
        params.validate()
        ids = self.encode_prompt(prompt)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
        req = Request(rid, ids, params, seed, self.tokenizer, self.eos_ids, self.max_model_len, self.lookahead)
        if self.pool.pages_for(req.reserve_tokens) > self.pool.num_usable_pages:
            raise InvalidRequestError(
                f"request needs {req.reserve_tokens} KV slots but the whole pool holds {self.pool.capacity_tokens}"
            )
        self._requests[rid] = req
        self.scheduler.add(req)
        return rid

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
        """Admit at most ``n`` running requests from now on (1..max_running_requests); requests
        already running are left alone.  Every step shape stays compiled for the configured
        maximum, so this needs no recompilation: a benchmark holds a steady batch of ``n`` with
        one engine built for its largest batch, and an operator can shed load at run time."""
        n = int(n)
        if not 1 <= n <= self.ec.max_running_requests:
            raise ValueError(f"max running must be in [1, {self.ec.max_running_requests}], got {n}")
        self.scheduler.max_running = n

    # -- stepping -------------------------------------------------------------------------
    def step(self) -> list[tuple[Request, list[int]]]:
        """Run one scheduling step; returns (request, newly committed ids) for requests that moved.

        Finished requests are released (slot and KV pages) before returning."""
        self.scheduler.admit()
        chunks = self.scheduler.next_prefill()
        if chunks:
            events = self._prefill_step(chunks)
        else:
            reqs = self.scheduler.decode_batch()
            events = self._decode(reqs) if reqs else self._drain()
        self._release_finished()
        return events

    def draft_step_options(self, prefill: bool) -> dict:
        """Keyword options of the speculative engines' jitted steps (spec/dspark/step.py,
        spec/mtp/step.py), from this engine's own execution settings: the fused kernels,
        and on the GPU unrolled loops for the rounds.  Prefill keeps its scans, as this engine's
        prefill does (compute-bound, once per request, and an unrolled executable compiles
        ~2-4x longer)."""
        unroll = self.unroll_decode and not prefill
        return dict(backend=self.backend, unroll=unroll,
                    target_options=(("scan_layers", not unroll), ("norm_backend", self.norm_backend),
                                    ("kv_write_backend", self.kv_write_backend)))

    def _release_finished(self) -> None:
        """Give finished requests' slots and KV pages back and forget them."""
        for req in self.scheduler.release_finished():
            self._requests.pop(req.id, None)

    def _prefill_step(self, chunks):
        """A scheduling step that prefills: the in-flight decode step is read first."""
        return self._drain() + self._prefill(chunks)

    def _prefill(self, chunks):
        T, S, batch, sampling = self._prefill_inputs(chunks)
        return self._commit_prefill(chunks, self.runner.run(batch, sampling))

    def _prefill_inputs(self, chunks):
        """(tokens bucket T, sequences S, ForwardBatch, sampling arrays) for prompt chunks [(request, n)]:
        every engine (plain or speculative) packs a prefill step the same way."""
        T = round_up(sum(n for _, n in chunks), self.prefill_buckets)
        S = self.prefill_seqs
        seqs = [
            (np.asarray(r.prompt_ids[r.num_cached : r.num_cached + n]), r.num_cached, self.pool.pages(r.id))
            for r, n in chunks
        ]
        batch = build_forward_batch(
            seqs, page_size=self.pool.page_size, num_tokens=T, num_seqs=S, pages_per_seq=self.pages_per_seq
        )
        reqs = [r for r, _ in chunks]
        sampling = sampling_arrays(
            [r.params for r in reqs], [r.seed for r in reqs], [len(r.prompt_ids) for r in reqs], S
        )
        return T, S, batch, sampling

    def _commit_prefill(self, chunks, tokens, on_complete=None):
        """Advance each chunk's request; one whose prompt is now cached starts decoding with its
        sampled first token (on_complete(request) runs first: slot assignment in the speculative engines)."""
        tokens = np.asarray(tokens)
        events = []
        for i, (r, n) in enumerate(chunks):
            r.num_cached += n
            if r.num_cached == len(r.prompt_ids):
                r.status = Status.DECODE
                if on_complete is not None:
                    on_complete(r)
                events.append((r, r.append_tokens([tokens[i]])))
        return events

    def _round_inputs(self, reqs, S: int):
        """Host arrays of a speculative round for reqs padded to S rows: live mask, page tables (as
        wide as the round's context bucket) and per-request sampling parameters (temperature,
        top_k, top_p, seed).

        A serving batch keeps the same requests for many rounds, so the arrays of the last
        (requests, S, width) are kept and returned again, read-only: rebuilding them took ~70 us
        of a batch-64 round's host time (CPU, benchmarks/profile_host_round.py)."""
        bs = len(reqs)
        # every position a round may touch: up to lookahead past each request's last committed token
        P = self.page_width(max((r.total_len for r in reqs), default=0) + self.lookahead)
        key = (S, P, tuple(reqs))  # the request objects themselves: ids may be reused once a request ends
        cached = self._last_round_inputs
        if cached is not None and cached[0] == key:
            return cached[1]
        live = np.zeros(S, bool)
        live[:bs] = True
        table = np.zeros((S, P), np.int32)
        if bs:
            table[:bs] = [self._page_row(r)[:P] for r in reqs]
        temp, top_k, top_p, seed, _ = sampling_arrays([r.params for r in reqs], [r.seed for r in reqs], [0] * bs, S)
        arrays = (live, table, temp, top_k, top_p, seed)
        for a in arrays:
            a.flags.writeable = False
        self._last_round_inputs = (key, arrays)
        return arrays

    def _page_row(self, r) -> np.ndarray:
        """r's page-table row, built once: admission reserves every page a request can need, so
        the row never changes while it runs (rebuilding it costs ~4 us per request per round)."""
        if r.page_row is None:
            r.page_row = self.pool.page_table_row(r.id, self.pages_per_seq)
        return r.page_row

    def _decode(self, reqs):
        """Decode one token for every running request.

        With overlap, when the batch is the one in flight the next step is dispatched first,
        fed on device by the in-flight step's tokens, and only then are those tokens read: the
        host's bookkeeping runs while the device computes.  A request that turns out to have
        finished in the step being read wasted one token's work in the step just dispatched;
        its output is ignored.  Any change of batch composition reads the in-flight step first."""
        prev = self._inflight
        if self.ec.overlap and prev is not None and prev[0] == reqs:
            self._inflight = self._dispatch_decode(reqs, prev[1])
            return self._read(prev)
        events = self._drain()
        reqs = [r for r in reqs if r.status is not Status.FINISHED]
        if reqs:
            self._inflight = self._dispatch_decode(reqs, None)
            if not self.ec.overlap:
                events += self._drain()
        return events

    def _dispatch_decode(self, reqs, fed_tokens):
        """fed_tokens: None (feed each request's last known token) or the device output of the
        in-flight step (one token ahead of what the host has seen)."""
        ahead = 0 if fed_tokens is None else 1
        B = round_up(len(reqs), self.decode_buckets)
        P = self.page_width(max(r.total_len for r in reqs) + ahead)
        seqs = [(np.asarray(r.output_ids[-1:]), r.total_len - 1 + ahead, self.pool.pages(r.id)[:P]) for r in reqs]
        batch = build_forward_batch(seqs, page_size=self.pool.page_size, num_tokens=B, num_seqs=B, pages_per_seq=P)
        if fed_tokens is not None:
            batch = batch._replace(input_ids=fed_tokens)
        positions = [r.total_len + ahead for r in reqs]
        sampling = sampling_arrays([r.params for r in reqs], [r.seed for r in reqs], positions, B)
        tokens = self.runner.run(batch, sampling, greedy=not sampling[0].any())
        tokens.copy_to_host_async()
        return reqs, tokens

    def _read(self, inflight):
        """Read a dispatched decode step's tokens (the one host sync) and commit them."""
        reqs, tokens = inflight
        tokens = np.asarray(tokens)
        events = []
        for i, r in enumerate(reqs):
            if r.status is Status.FINISHED:
                continue  # finished (or aborted) in an earlier step: this token was speculative work
            r.num_cached += 1
            events.append((r, r.append_tokens([tokens[i]])))
        return events

    def _drain(self):
        if self._inflight is None:
            return []
        inflight, self._inflight = self._inflight, None
        return self._read(inflight)

    # -- batch API ------------------------------------------------------------------------
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
            (dataclasses.replace(sp) if sp else SamplingParams()).validate()
        reqs = []
        for p, sp in zip(prompts, params):
            rid = self.add_request(p, sp)
            reqs.append(self._requests[rid])
        t0 = time.perf_counter()
        while any(r.status is not Status.FINISHED for r in reqs):
            self.step()
        # An overlapped loop dispatched one step ahead for requests that turned out finished:
        # settle it here, so its time and statistics do not spill into the next call.
        self._drain()
        self._release_finished()
        wall = time.perf_counter() - t0
        n = sum(len(r.output_ids) for r in reqs)
        self.last_generate_stats = {"wall_s": wall, "completion_tokens": n, "tokens_per_s": n / wall if wall else None}
        return [r.result() for r in reqs]
