"""Profile a DSpark worker's step costs on this device and fit the additive table from them.

What benchmarks/profile_sps.py runs offline and what a server without a table runs at start-up
(SGLang derives its table from the captured CUDA graphs the same way): each compiled round
timed alone on a steady synthetic batch, for every batch-size bucket at a few verify budgets,
plus a plain decode step per bucket, then the additive fit (cost_model.fit_additive_cost) with
the decode curve beside it.  A derived table is cached on disk by everything that sets the
costs, so a restart reads it back instead of timing again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from dspark_jax.spec.dspark.cost_model import AdditiveCostTable, CostFit, fit_additive_cost

log = logging.getLogger(__name__)

DEFAULT_FRACTIONS = (0.0, 0.5, 1.0)


def profile_cells(worker, batch_sizes: Sequence[int], fractions: Sequence[float] = DEFAULT_FRACTIONS, *,
                  context: int, sampling=(0.0, 0, 1.0), iters: int = 3, warmup: int = 1,
                  progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Timed cells: {"bs", "K" (None for a plain decode step), "M", "tier", "seconds"}, one per
    (batch size, fraction of the full budget) and one plain decode step per batch size."""
    G = worker.gamma
    grid = [(bs, int(round(f * bs * G))) for bs in batch_sizes for f in fractions] + [(bs, None) for bs in batch_sizes]
    cells = []
    for i, (bs, K) in enumerate(grid):
        tier, seconds = worker.time_round(bs, K, context, sampling, iters=iters, warmup=warmup)
        cells.append({"bs": bs, "K": K, "M": bs + (K or 0), "tier": tier, "seconds": seconds})
        if progress is not None:
            progress(i + 1, len(grid))
    return cells


def fit_cells(cells: Sequence[dict], m_bin: int = 64, monotone: bool = True) -> CostFit:
    """The additive fit of the speculative cells, its table carrying the plain decode curve (the
    median per batch size, made non-decreasing) when the cells hold decode steps."""
    spec = [c for c in cells if c["K"] is not None]
    fit = fit_additive_cost([(c["bs"], c["M"], c["seconds"]) for c in spec], m_bin=m_bin, monotone=monotone)
    decode = [c for c in cells if c["K"] is None]
    if not decode:
        return fit
    probes = sorted({c["bs"] for c in decode})
    seconds = [float(np.median([c["seconds"] for c in decode if c["bs"] == b])) for b in probes]
    return dataclasses.replace(fit, table=fit.table.with_decode(probes, np.maximum.accumulate(seconds)))


def _cache_key(worker, context: int) -> str:
    e = worker.engine
    facts = {"target": dataclasses.asdict(e.config), "drafter": dataclasses.asdict(worker.drafter.config),
             "max_running": e.ec.max_running_requests, "page_size": e.ec.page_size, "pages": e.pages_per_seq,
             "kernels": [e.runner.backend, e.runner.norm_backend, e.runner.kv_write_backend], "unroll": e.runner.unroll,
             "dtype": str(e.runner.dtype), "rounds": worker.rounds, "context": context,
             "shapes": worker.tiers.shapes(),  # the compiled (tokens, rows) a round's cost depends on
             "device": e.parallel.device.device_kind, "jax": jax.__version__}
    if e.parallel.tp_size > 1:  # (absent at tp 1, so single-device tables keep their keys)
        facts["tp_size"] = e.parallel.tp_size
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def derive_cost_table(worker, cache_dir: str | Path | None = None) -> AdditiveCostTable:
    """This device's table for the worker's engine: read from the cache, else profiled over every
    batch-size bucket at a context of half the model length (at most 512) and fitted."""
    from dspark_jax.engine.model_runner import DEFAULT_CACHE_DIR

    e = worker.engine
    context = min(512, e.max_model_len // 2)
    path = Path(cache_dir or DEFAULT_CACHE_DIR.parent / "tables") / f"{_cache_key(worker, context)}.json"
    if path.exists():
        try:
            table = AdditiveCostTable.load(path)
            log.info("cost table read from %s", path)
            return table
        except (OSError, ValueError) as err:
            log.warning("ignoring the cached cost table %s: %s", path, err)
    t0 = time.perf_counter()
    report = lambda done, total: log.info("profiling step costs: %d/%d cells", done, total)
    fit = fit_cells(profile_cells(worker, e.decode_buckets, context=context, progress=report))
    log.info("cost table derived in %.1f s (R^2 %.3f); cached at %s", time.perf_counter() - t0, fit.r_squared, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fit.table.save(path)
    return fit.table
