"""MTPEngine: the batch engine with the MTP / EAGLE-style chain drafter (the baseline arm).

Same request lifecycle as Engine (slots, KV admission, chunked prefill, stop handling); the
decode step is replaced by a chain speculative round (dspark_jax/spec/mtp/step.py):
draft k tokens one after another, verify anchor + k with the target, commit the accepted
prefix and the bonus.  SGLang's notation "k-1-(k+1)" (e.g. 3-1-4) is num_steps = k.

The drafter's one-layer KV cache shares the target's page ids (row p at the target's slot of
p), so the page pool is sized for both, and every request reserves k + 1 positions past its
committed length: the round's verify writes anchor + k rows, the chain steps k - 1 of them.
Between calls the rows the target committed but the drafter has not yet read are carried on
device in a small per-slot buffer (mtp_step.Pending), so a request holds a slot index from the
prefill chunk that completes its prompt until it finishes.

Verification is always static (all k drafts), so the executable of a round depends only on the
batch size: one per token tier bs * (k + 1) of the batch-size ladder, compiled ahead of time.
The host reads back the drafts and accept counts once per round.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.engine.engine import Engine, EngineConfig
from dspark_jax.engine.flat_state import flatten_states, with_flat_states
from dspark_jax.engine.host_pack import HostPack, with_packed_inputs, with_packed_outputs
from dspark_jax.engine.request import Status
from dspark_jax.spec.common.stats import commit_rounds, new_round_stats, summarize_rounds
from dspark_jax.forward_batch import shape_struct
from dspark_jax.models.qwen3 import Qwen3ForCausalLM
from dspark_jax.spec.mtp.model import MTPDrafter, allocate_mtp_cache
from dspark_jax.spec.mtp.step import MTPInputs, MTPOutputs, allocate_pending, mtp_prefill_step, mtp_spec_step
from dspark_jax.spec.common.tiers import TokenTiers
from dspark_jax.tokenizer import Tokenizer

DEFAULT_NUM_STEPS = 3  # SGLang's EAGLE 3-1-4


class MTPEngine(Engine):
    def __init__(self, model: Qwen3ForCausalLM, tokenizer: Tokenizer | None, drafter: MTPDrafter,
                 config: EngineConfig | None = None, *, num_steps: int = DEFAULT_NUM_STEPS):
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps (MTP draft steps) must be an integer >= 1, got {num_steps!r}")
        drafter.config.check_target(model.config)
        ec = dataclasses.replace(config or EngineConfig(), precompile=False)  # no plain decode buckets
        self.drafter = drafter  # before sizing the page pool: the draft cache shares its pages
        super().__init__(model, tokenizer, ec)
        self.num_steps = self.gamma = k = num_steps  # gamma: drafts per round, as the DSpark engine names it
        self.lookahead = k + 1
        self.tiers = TokenTiers(k, self.decode_buckets)
        runner = self.runner
        self.tcache, runner.cache = runner.cache, None
        self.dcache = allocate_mtp_cache(drafter.config, self.pool.num_pages, self.pool.page_size, self.tcache.k.dtype)
        self.pending = allocate_pending(self.ec.max_running_requests, k, self.config.hidden_size, model.dtype)
        self.target_def, self.target_state = runner.graphdef, runner.state
        self.drafter_def, self.drafter_state = nnx.split(drafter)
        # The steps take both states as flat leaf lists (engine/flat_state.py: cheaper dispatch).
        self.state_args, state_defs = flatten_states(self.target_state, self.drafter_state)
        # the same execution options as the DSpark engine's steps, so the two arms compare evenly
        self._prefill_jit = jax.jit(
            with_flat_states(functools.partial(mtp_prefill_step, self.target_def, self.drafter_def,
                                               **self.draft_step_options(prefill=True)),
                             state_defs), donate_argnums=(2, 3, 4))
        # host inputs packed into one transfer and the results into one on the way back, as the
        # DSpark engine's rounds (engine/host_pack.py)
        self._spec_jit = jax.jit(
            with_packed_outputs(with_packed_inputs(with_flat_states(
                functools.partial(mtp_spec_step, self.target_def, self.drafter_def, page_size=self.pool.page_size,
                                  **self.draft_step_options(prefill=False)), state_defs), index=5)),
            donate_argnums=(2, 3, 4), static_argnames=("num_tokens", "pack", "out_pack"))
        self._spec_packs: dict[tuple[int, int], HostPack] = {}  # by (S, P): the round inputs' layout
        self._out_packs: dict[int, HostPack] = {}  # by S: the round results' layout
        self._compiled: dict = {}
        self._slot_of: dict[str, int] = {}
        self.stats = new_round_stats()
        self.compile_seconds = self._compile_all() if (config or EngineConfig()).precompile else 0.0

    def _extra_kv_bytes_per_token(self, model) -> int:
        d = self.drafter.config
        return 2 * d.num_key_value_heads * d.head_dim * jnp.dtype(model.dtype).itemsize  # one layer

    @classmethod
    def from_pretrained(cls, path: str | Path, mtp_path: str | Path, config: EngineConfig | None = None, *,
                        num_steps: int | None = None) -> "MTPEngine":
        """Target folder (Hugging Face Qwen3) + MTP drafter folder (dspark_jax.spec.mtp.model.save_mtp).

        num_steps: None takes the folder's speculative.json, else DEFAULT_NUM_STEPS."""
        from dspark_jax.checkpoint import load_model
        from dspark_jax.spec.mtp.model import load_mtp, stored_num_steps

        ec = config or EngineConfig()
        dtype = ec.dtype or ("float32" if jax.default_backend() == "cpu" else None)
        tcfg, model = load_model(path, dtype=dtype)
        drafter = load_mtp(mtp_path, dtype=model.dtype, target=tcfg)
        k = num_steps if num_steps is not None else (stored_num_steps(mtp_path) or DEFAULT_NUM_STEPS)
        return cls(model, Tokenizer.from_folder(path), drafter, ec, num_steps=k)

    # -- compilation ------------------------------------------------------------------------
    def _spec_shape(self, batch_size: int) -> tuple[int, int]:
        """(tokens, request slots) of a round: the tier bs * (k + 1) of the ladder bucket."""
        T = self.tiers.round_up(batch_size * (self.num_steps + 1))
        return T, T // (self.num_steps + 1)

    def _compile_all(self) -> float:
        t0 = time.perf_counter()
        for t in self.prefill_buckets:
            self._compiled_prefill(t, self.prefill_seqs)
        for b in self.decode_buckets:
            for P in self.page_widths:
                self._compiled_spec(*self._spec_shape(b), P)
        return time.perf_counter() - t0

    @staticmethod
    def _abstract(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)

    def _compiled_prefill(self, T: int, S: int):
        key = ("prefill", T, S)
        if key not in self._compiled:
            s = jax.ShapeDtypeStruct
            samp = tuple(s((S,), d) for d in (np.float32, np.int32, np.float32, np.uint32, np.int32))
            self._compiled[key] = self._prefill_jit.lower(
                *self.state_args, self._abstract(self.tcache), self._abstract(self.dcache),
                self._abstract(self.pending), shape_struct(T, S, self.pages_per_seq, S), samp,
                s((T,), np.int32), s((S,), np.int32)).compile()
        return self._compiled[key]

    def _compiled_spec(self, T: int, S: int, P: int):
        key = ("spec", T, S, P)
        if key not in self._compiled:
            s = jax.ShapeDtypeStruct
            i32 = np.int32
            inp = MTPInputs(s((S,), i32), s((S,), i32), s((S, P), i32), s((S,), np.bool_), s((), i32),
                            s((S,), i32), s((S,), np.float32), s((S,), i32), s((S,), np.float32), s((S,), np.uint32))
            pack = self._spec_packs.setdefault((S, P), HostPack.of(inp))
            out_pack = self._out_packs.setdefault(S, HostPack.of(MTPOutputs(*(s(shape, i32) for shape in (
                (S, self.num_steps), (S,), (S,), (S,), (S,))))))
            self._compiled[key] = self._spec_jit.lower(
                *self.state_args, self._abstract(self.tcache), self._abstract(self.dcache),
                self._abstract(self.pending), pack.spec(), (), num_tokens=T, pack=pack, out_pack=out_pack).compile()
        return self._compiled[key]

    # -- slots ------------------------------------------------------------------------------
    def _assign_slot(self, r) -> int:
        if r.id not in self._slot_of:
            used = set(self._slot_of.values())
            self._slot_of[r.id] = next(i for i in range(self.ec.max_running_requests) if i not in used)
        return self._slot_of[r.id]

    def _release_if_finished(self, r) -> None:
        if r.status is Status.FINISHED:
            self._slot_of.pop(r.id, None)

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self._slot_of.pop(request_id, None)

    # -- steps ------------------------------------------------------------------------------
    def _prefill(self, chunks):
        T, S, batch, samp = self._prefill_inputs(chunks)
        next_ids = np.zeros(T, np.int32)  # the prompt token after each row (the sampled one is filled in on device)
        final_slot = np.full(S, -1, np.int32)
        t = 0
        for i, (r, n) in enumerate(chunks):
            nxt = r.prompt_ids[r.num_cached + 1: r.num_cached + n + 1]
            next_ids[t: t + len(nxt)] = nxt
            if r.num_cached + n == len(r.prompt_ids):
                final_slot[i] = self._assign_slot(r)
            t += n
        fn = self._compiled_prefill(T, S)
        tokens, self.tcache, self.dcache, self.pending = fn(
            *self.state_args, self.tcache, self.dcache, self.pending, batch, samp, next_ids,
            final_slot)
        events = self._commit_prefill(chunks, tokens)
        for r, _ in events:
            self._release_if_finished(r)
        return events

    def _decode(self, reqs):
        bs = len(reqs)
        T, S = self._spec_shape(bs)
        pad = lambda a, dt: np.concatenate([np.asarray(a, dt), np.zeros(S - bs, dt)])
        live, table, temp, top_k, top_p, seed = self._round_inputs(reqs, S)
        inp = MTPInputs(pad([r.output_ids[-1] for r in reqs], np.int32), pad([r.total_len - 1 for r in reqs], np.int32),
                        table, live, np.int32(bs), pad([self._slot_of[r.id] for r in reqs], np.int32),
                        temp, top_k, top_p, seed)
        P = table.shape[1]
        fn = self._compiled_spec(T, S, P)
        results, _, self.tcache, self.dcache, self.pending = fn(*self.state_args, self.tcache, self.dcache,
                                                                self.pending, self._spec_packs[S, P].pack(inp), ())
        return self._commit(reqs, self._out_packs[S].unpack_host(jax.device_get(results)))  # the one read per round

    def _commit(self, reqs, out: MTPOutputs):
        """Commit drafts[:a] + bonus per request (cut at a stop condition) and record the round."""
        self.stats["rounds"] += 1
        done = commit_rounds(self.stats, reqs, out.drafts, out.num_accepted, out.bonus, out.verify_lens,
                             out.block_accept)
        for r, _, _ in done:
            self._release_if_finished(r)
        return [(r, committed) for r, _, committed in done]

    def summary(self) -> dict:
        """Aggregate speculative statistics since start-up, with the keys the DSpark engine reports."""
        return {"mode": "mtp", "num_steps": self.num_steps, **summarize_rounds(self.stats, self.num_steps)}
