"""ModelRunner: the target's parameters, its paged KV cache, and how every step runs it.

Each step is a jitted function compiled ahead of time per static shape (the XLA analogue of a
captured CUDA graph per batch size); the cache is donated into every call and replaced by the
step's output.  The persistent compilation cache makes restarts cheap.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import threading
import time
from pathlib import Path

import jax
from flax import nnx

from dspark_jax.engine.flat_state import flatten_states
from dspark_jax.kv_cache import KVCache
from dspark_jax.layers.attention import resolve_backend
from dspark_jax.layers.layer_split import is_split
from dspark_jax.models.qwen3 import Qwen3ForCausalLM
from pallas_kernels.fused_add_rms_norm import resolve_backend as resolve_norm_backend
from pallas_kernels.kv_write import resolve_backend as resolve_kv_write_backend

log = logging.getLogger(__name__)

# XLA's rematerialization pass counts a step's donated, aliased outputs (the KV caches) as new
# buffers beside the donated arguments, so with a large pool it finds the step "over" the device
# and spends minutes failing to shrink it; buffer assignment then aliases them and the step needs
# only small temporaries (benchmarks/step_memory.py shows both).  A serving step has nothing to
# rematerialize: its memory is the weights and the caches.
GPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}

# XLA:CPU has aborted a process in deserialize_executable (and once segfaulted in
# serialize_executable) while reading the persistent compilation cache, first seen with two
# compile threads, later with one (docs/decisions.md).  On the CPU one compile at a time per
# process, and compile_engines builds on one thread; GPU start-up keeps its parallel compile (it
# has never crashed there, and it is where start-up time matters).
_CPU_COMPILE_LOCK = threading.Lock()

DEFAULT_CACHE_DIR = Path(os.environ.get("DSPARK_JAX_CACHE", Path.home() / ".cache" / "dspark_jax")) / "xla"


def enable_compilation_cache(path: str | Path | None = None) -> None:
    """Turn on JAX's persistent compilation cache (every executable, however quick to compile),
    after removing what an interrupted write left in it (repair_compilation_cache)."""
    path = Path(path or DEFAULT_CACHE_DIR)
    path.mkdir(parents=True, exist_ok=True)
    if str(path) not in _REPAIRED:
        _REPAIRED.add(str(path))
        removed = repair_compilation_cache(path)
        if removed:
            log.warning("removed %d incomplete entries from the compilation cache %s", removed, path)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A size bound turns on JAX's file lock: without it, a process can read an entry another
    # process (a second server, a test worker) is still writing.
    jax.config.update("jax_compilation_cache_max_size", 32 * 2**30)


_REPAIRED: set[str] = set()  # cache folders this process has checked


def repair_compilation_cache(path: Path) -> int:
    """Delete entries whose write never finished; returns how many.  JAX writes an entry's
    executable, then its access time, under the cache's file lock; a process killed in between
    (a timeout, an OOM kill) leaves an executable without an access time, possibly truncated.
    JAX's size check reads every entry's access time, so from then on every write to the cache
    fails and every start compiles from scratch; reading a truncated executable can abort the
    process.  Done under JAX's own lock, so no write in progress elsewhere is mistaken for one."""
    import filelock

    try:
        with filelock.FileLock(path / ".lockfile", timeout=10):
            orphans = [p for p in path.glob("*-cache") if not p.with_name(p.name[: -len("-cache")] + "-atime").exists()]
            for p in orphans:
                p.unlink(missing_ok=True)
    except filelock.Timeout:
        log.warning("the compilation cache %s stayed locked; not checked for incomplete entries", path)
        return 0
    return len(orphans)


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


def abstract(tree):
    """ShapeDtypeStructs of a tree of arrays, for lowering a step without its data; a device
    array's sharding comes along (a step of a sharded or non-default-device engine is compiled
    for the shardings its arrays have)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_placed(x)), tree)


def _placed(x):
    """x's sharding when it is a device array not simply on the default device, else None (a
    single-device engine lowers exactly as it always did)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or not isinstance(x, jax.Array):
        return None
    if isinstance(sharding, jax.sharding.SingleDeviceSharding) and sharding.device_set == {jax.devices()[0]}:
        return None
    return sharding


class ModelRunner:
    """The target model as the steps see it: flat parameter leaves, the KV cache, the kernels."""

    def __init__(self, model: Qwen3ForCausalLM, cache: KVCache, *, kernels: str = "auto", unroll: bool = False,
                 parallel=None):
        """parallel: the engine's dspark_jax.parallel.runtime.Parallel (None: the default device);
        under tensor parallelism graphdef is the per-shard structure and state its sharded leaves."""
        self.config = model.config
        self.dtype = model.dtype
        self.unroll = bool(unroll)
        # split by the engine where it unrolls large layers: every step unrolls (a model loaded into shards is not)
        self.split = isinstance(model, nnx.Module) and is_split(model.layers)
        if parallel is None or parallel.default:
            self.graphdef, state = nnx.split(model)
            (self.state,), (self.state_def,) = flatten_states(state)  # dispatched as a flat list
        else:
            self.graphdef, self.state, self.state_def = parallel.split_module(model, "target")
        self.parallel = parallel
        self.cache = cache
        self.backend = resolve_backend(kernels)
        self.norm_backend = resolve_norm_backend(kernels, self.config.hidden_size)
        self.kv_write_backend = resolve_kv_write_backend(kernels, self.config.head_dim)
        self.platform = (parallel.device if parallel is not None else jax.devices()[0]).platform
        self.compiler_options = dict(GPU_COMPILER_OPTIONS) if self.platform == "gpu" else {}
        # (start, end) of every compile since the last call to take_compile_spans()
        self._compile_spans: list[tuple[float, float]] = []

    def forward_options(self, prefill: bool) -> dict:
        """Keyword options of a target forward: the kernels and the layer loop.  Where the runner
        unrolls (the GPU), its layers are split (layers/layer_split.py) and every step, prefill
        included, runs unrolled; under tensor parallelism decode steps unroll over the stacks and
        prefill scans; on the CPU every step scans."""
        return dict(backend=self.backend, scan_layers=not self.split and (prefill or not self.unroll),
                    norm_backend=self.norm_backend, kv_write_backend=self.kv_write_backend)

    def compile(self, lowered, *, stalls: bool = True) -> jax.stages.Compiled:
        """Compile, noting when: time spent compiling on first use is kept out of measured rounds
        (stalls=False: a background compile, which holds up no round)."""
        t0 = time.perf_counter()
        with _CPU_COMPILE_LOCK if self.platform == "cpu" else contextlib.nullcontext():
            compiled = lowered.compile(compiler_options=self.compiler_options or None)
        if stalls:
            self._compile_spans.append((t0, time.perf_counter()))
        return compiled

    def take_compile_spans(self) -> list[tuple[float, float]]:
        spans, self._compile_spans = self._compile_spans, []
        return spans
