"""What the DSpark and MTP workers share: the drafter beside the target, its paged cache, packed
transfers, and the round statistics."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from dspark_jax.engine.background_compile import own_or_cover
from dspark_jax.engine.flat_state import flatten_states, with_flat_states
from dspark_jax.engine.host_pack import HostPack, with_packed_inputs, with_packed_outputs
from dspark_jax.engine.worker import Worker, prefill_batch, prefill_level, prefill_tokens
from dspark_jax.spec.common.stats import new_round_stats, summarize_rounds
from dspark_jax.spec.config import SpeculativeConfig


class DraftWorker(Worker):
    """A worker with a drafter: ``gamma`` drafts per round, a draft cache sharing the target's
    page ids (row p of a request at the target's slot of p)."""

    gamma: int

    def __init__(self, drafter, spec: SpeculativeConfig):
        spec.validate()
        self.drafter = drafter
        self.spec = spec

    def bind(self, engine) -> None:
        super().bind(engine)
        runner = engine.runner
        par = engine.parallel
        if par.default:
            graphdef, state = nnx.split(self.drafter)
            self.drafter_def = graphdef
            (self.drafter_state,), (drafter_state_def,) = flatten_states(state)
        else:  # placed on the engine's devices (per shard under tensor parallelism)
            self.drafter_def, self.drafter_state, drafter_state_def = par.split_module(self.drafter, "drafter")
        self.state_defs = (runner.state_def, drafter_state_def)
        self.dcache = self.allocate_draft_cache(engine.pool.num_pages, engine.pool.page_size, runner.dtype)
        self._compiled: dict = {}
        self._packs: dict = {}

    def allocate_draft_cache(self, num_pages: int, page_size: int, dtype):
        raise NotImplementedError

    # -- compiled steps ------------------------------------------------------------------------
    def jit_step(self, fn, *, donate: tuple[int, ...], packed_input: int | None = None, packed_output: bool = False,
                 static: tuple[str, ...] = (), ins: tuple = (), outs: tuple = ()):
        """jax.jit of ``fn(target_state, drafter_state, *rest)`` taking both states as flat leaf
        lists; with packed_input = i, argument i is a NamedTuple passed as one int32 buffer plus
        its device fields (engine/host_pack.py), and with packed_output the first result's host
        fields come back as one buffer.  ins / outs: what each argument after the two states and
        each result is ("kv": a paged cache, None: replicated), for the per-shard step of a
        tensor-parallel engine (Parallel.shard_step)."""
        fn = with_flat_states(fn, self.state_defs)
        if packed_input is not None:
            fn = with_packed_inputs(fn, index=packed_input)
            static += ("pack",)
        if packed_output:
            fn = with_packed_outputs(fn)
            static += ("out_pack",)
        fn = self.engine.parallel.shard_step(fn, ins=("target", "drafter", *ins), outs=outs)
        return jax.jit(fn, donate_argnums=donate, static_argnames=static)

    def lstate(self, processed: int | bool):
        """The logit-processor state a step takes: the engine's in a prefill (where the engine
        has one) or a processed round (with the grammar state in a CONSTRAINED one), else None."""
        processors = self.engine.processors
        return processors.state_for(processed) if processors is not None else None

    def keep_lstate(self, lstate) -> None:
        """Store the state a step returned (donated: the old one is gone)."""
        if lstate is not None:
            self.engine.processors.keep(lstate)

    def processed_variants(self) -> tuple[bool, ...]:
        """Which round variants compile with the others: processed ones too where the engine
        precompiles its logit processors."""
        processors = self.engine.processors
        return (False, True) if processors is not None and processors.precompile else (False,)

    def release_device_memory(self) -> None:
        """The drafter's weights, its cache and the compiled rounds go."""
        self.dcache = self.drafter_state = None
        self._compiled.clear()

    def executable(self, key, lower, *, optional: bool = False):
        """The compiled executable for key, lowering and compiling it on first use (optional:
        only requests with logit processors or a grammar need it, Engine.compiled)."""
        return self.engine.compiled(self._compiled, key, lower, optional=optional)

    def step_executable(self, key: tuple):  # ("prefill" or "round", *that executable's arguments)
        return (self._prefill_executable if key[0] == "prefill" else self._round_executable)(*key[1:])

    def prefill_inputs(self, chunks) -> tuple:
        """(packed batch, sampling arrays, processing level, executable) of a prefill of prompt
        chunks: its own token bucket's, or while that compiles in the background, a wider one's."""
        e, level = self.engine, prefill_level(chunks)
        (_, T, _, _), fn = own_or_cover(self._compiled, ("prefill", prefill_tokens(e, chunks), e.prefill_seqs, level),
                                        self.step_executable, dims=(1,), widest=None)
        return *prefill_batch(e, chunks, T), level, fn

    def widest_prefill(self) -> tuple:
        """The key of the widest prefill (most tokens)."""
        e = self.engine
        return ("prefill", max(e.prefill_buckets), e.prefill_seqs, True)

    def pack(self, key, abstract_inputs: Callable[[], tuple], device_fields: tuple[str, ...] = ()) -> HostPack:
        """The (cached) host-buffer layout of a NamedTuple of inputs or results.  abstract_inputs
        builds the NamedTuple's shapes, only on a miss: a dispatch looks its packs up every call."""
        pack = self._packs.get(key)
        if pack is None:
            pack = self._packs[key] = HostPack.of(abstract_inputs(), device_fields)
        return pack

    # -- statistics ----------------------------------------------------------------------------
    def new_stats(self, *extra: str) -> dict:
        self.stats = new_round_stats(*extra)
        return self.stats

    def summary(self) -> dict:
        return {"algorithm": self.name, **summarize_rounds(self.stats, self.gamma)}
