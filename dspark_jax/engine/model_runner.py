"""ModelRunner: the target's parameters, its KV cache and one compiled executable per shape bucket.

Each bucket (tokens T, sequences S, logits rows R, page-table width P) is lowered and compiled
ahead of time at start-up with the KV cache donated, the XLA analogue of capturing a CUDA graph
per batch size.  The persistent compilation cache makes restarts cheap.  A step is dispatched by
picking the smallest bucket that holds the batch (and the smallest context bucket that holds its
longest request), so a small batch really runs a small executable.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from dspark_jax.engine.flat_state import flatten_states, with_flat_states
from dspark_jax.forward_batch import ForwardBatch, shape_struct
from dspark_jax.kv_cache import KVCache
from dspark_jax.models.qwen3 import Qwen3ForCausalLM
from dspark_jax.sampling import SAMPLING_VARIANTS, sample

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path(os.environ.get("DSPARK_JAX_CACHE", Path.home() / ".cache" / "dspark_jax")) / "xla"


def enable_compilation_cache(path: str | Path | None = None) -> None:
    """Turn on JAX's persistent compilation cache (every executable, however quick to compile)."""
    path = Path(path or DEFAULT_CACHE_DIR)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def round_up(value: int, buckets: list[int]) -> int:
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def batch_ladder(max_value: int, start: int = 1) -> list[int]:
    """Powers of two from `start` up to `max_value`, with `max_value` itself as the last bucket."""
    out, v = [], start
    while v < max_value:
        out.append(v)
        v *= 2
    return out + [max_value]


def _sampling_struct(rows: int):
    s = jax.ShapeDtypeStruct
    return (
        s((rows,), np.float32),
        s((rows,), np.int32),
        s((rows,), np.float32),
        s((rows,), np.uint32),
        s((rows,), np.int32),
    )


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, cache: KVCache, *, backend: str,
                 unroll_decode: bool = False, lazy: bool = False, norm_backend: str = "reference",
                 kv_write_backend: str = "reference", sampling_variants: bool = False):
        """unroll_decode: compile decode buckets (tokens == seqs) with the layer loop unrolled.

        Under ``lax.scan`` XLA:GPU materialises each layer's weight slice before its GEMM (a
        copy of every weight, every step: measured 3.2x the HBM floor at batch 1 on an H200);
        with static slices it reads the stacked weights in place (1.7x on the same model).
        Prefill and verify buckets, which are compute-bound, keep the compact scan.
        lazy: compile a bucket on first use instead of failing (benchmarks, quick scripts).
        norm_backend: how residual add + RMSNorm run (models/qwen3.py ``add_rms_norm``);
        kv_write_backend: how k is normed and rotated and K/V written (``Qwen3Attention``).
        sampling_variants: compile decode buckets twice, for all-greedy batches and for batches
        that sample (sampling.sample's "greedy" / "stochastic"), instead of once with a device-side
        ``lax.cond`` ("any"), which on the GPU blocks the host inside every step."""
        self.graphdef, self.state = nnx.split(model)
        (self.state_leaves,), state_defs = flatten_states(self.state)  # dispatched as a flat list
        self.config = model.config
        self.cache = cache
        self.backend = backend
        self.unroll_decode = unroll_decode
        self.lazy = lazy
        self.sampling_variants = sampling_variants
        # by (bucket, sampling variant)
        self._compiled: dict[tuple[tuple[int, int, int, int], str], jax.stages.Compiled] = {}
        graphdef = self.graphdef

        def make_step(scan_layers: bool, variant: str):
            def step(state, cache, batch: ForwardBatch, sampling):
                model = nnx.merge(graphdef, state)
                out = model(cache, batch, backend=backend, scan_layers=scan_layers, norm_backend=norm_backend,
                            kv_write_backend=kv_write_backend)
                return sample(out.logits, *sampling, variant=variant), out.cache

            # Positional donation: the cache buffers are reused in place, never copied.
            return jax.jit(with_flat_states(step, state_defs), donate_argnums=(1,))

        self._jitted = {(scan, v): make_step(scan, v) for scan in (True, False) for v in SAMPLING_VARIANTS}

    def variants(self, bucket: tuple[int, int, int, int]) -> tuple[str, ...]:
        """The sampling variants compiled for a bucket: both host-chosen ones for decode
        buckets (tokens == seqs == logits rows) with sampling_variants, else the device-chosen one."""
        T, S, R, _ = bucket
        return ("greedy", "stochastic") if self.sampling_variants and T == S == R else ("any",)

    def compile(self, buckets: list[tuple[int, int, int, int]]) -> float:
        """Lower and compile every (tokens, seqs, logits rows, page-table width) bucket; returns
        seconds spent."""
        t0 = time.perf_counter()
        abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
        state_s, cache_s = abstract(self.state_leaves), abstract(self.cache)
        for b in buckets:
            T, S, R, P = b
            scan = not (self.unroll_decode and T == S == R)
            for v in self.variants(b):
                if (b, v) not in self._compiled:
                    self._compiled[b, v] = self._jitted[scan, v].lower(
                        state_s, cache_s, shape_struct(T, S, P, R), _sampling_struct(R)
                    ).compile()
        dt = time.perf_counter() - t0
        log.info("compiled %d step buckets in %.1fs", len(buckets), dt)
        return dt

    def run(self, batch: ForwardBatch, sampling, *, greedy: bool = False) -> jax.Array:
        """Dispatch one step; returns the sampled token ids (a device array, not yet read).
        greedy: every row has temperature 0 (the caller knows; picks the greedy variant where
        one is compiled)."""
        S, P = batch.page_table.shape
        key = (batch.input_ids.shape[0], S, batch.logits_indices.shape[0], P)
        variants = self.variants(key)
        variant = variants[0] if len(variants) == 1 else ("greedy" if greedy else "stochastic")
        fn = self._compiled.get((key, variant))
        if fn is None and self.lazy:
            self.compile([key])
            fn = self._compiled[key, variant]
        if fn is None:
            raise KeyError(f"no compiled executable for bucket {key}; compiled: {self.compiled_buckets}")
        tokens, self.cache = fn(self.state_leaves, self.cache, batch, sampling)
        return tokens

    @property
    def compiled_buckets(self) -> list[tuple[int, int, int, int]]:
        return sorted({b for b, _ in self._compiled})
