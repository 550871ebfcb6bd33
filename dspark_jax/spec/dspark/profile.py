"""Profile a DSpark engine's round costs on this device and fit the additive table from them.

What a server without a table runs at start-up (SGLang derives its table from its captured CUDA
graphs; benchmarks/profile_sps.py runs the same offline): requests of a synthetic prompt run
through the engine's own loop with every round forced to one verify budget, for each batch-size
bucket at a few budgets, plus plain decode rounds per bucket; each cell is the median round
period the loop itself measures, then comes the additive fit (cost_model.fit_additive_cost)
with the decode curve beside it.  Timing the loop rather than the round executable alone is
what makes the table price what serving pays: rounds dispatched back to back without the loop's
host work and feeds came out 25-35% cheaper than the loop's at the 8B shape from batch 4 up
(docs/decisions.md).  A derived table is cached on disk by everything that sets the costs, so a
restart reads it back instead of timing again.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from dspark_jax.engine.request import Status
from dspark_jax.sampling import SamplingParams
from dspark_jax.spec.dspark.cost_model import AdditiveCostTable, CostFit, fit_additive_cost

log = logging.getLogger(__name__)

DEFAULT_FRACTIONS = (0.0, 0.5, 1.0)


def profile_cells(engine, batch_sizes: Sequence[int], fractions: Sequence[float] = DEFAULT_FRACTIONS, *,
                  context: int, sampling: SamplingParams | None = None, warmup: int = 3, iters: int = 8,
                  progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Timed cells: {"bs", "K" (None for a plain decode step), "M", "tier", "seconds"}, one per
    (batch size, fraction of the full budget) and one plain decode step per batch size, each the
    median of ``iters`` round periods of the engine's loop after ``warmup`` rounds (which absorb
    compiling and the switch from the cell before).  The engine must be idle; requests queued
    meanwhile wait for the profile.  sampling: the profiled requests' (default greedy)."""
    worker, G = engine.worker, engine.worker.gamma
    if engine.background is not None:  # a round padded onto a wider shape would price the wrong tier
        engine.background.finish()
    grid = [(bs, int(round(f * bs * G))) for bs in batch_sizes for f in fractions] + [(bs, "decode") for bs in batch_sizes]
    grid.sort(key=lambda cell: cell[0])  # one batch of requests per batch size
    params = dataclasses.replace(sampling or SamplingParams(), ignore_eos=True, stop_token_ids=(), seed=0)
    rng = np.random.default_rng(0)
    held, engine.scheduler.waiting = engine.scheduler.waiting, collections.deque()
    batch: list = []
    cells = []
    try:
        for i, (bs, K) in enumerate(grid):
            need = (warmup + iters + 2) * (1 if K == "decode" else G + 1)  # positions the cell may commit
            if len(batch) != bs or any(r.max_new - len(r.output_ids) < need for r in batch):
                _drop(engine, batch)
                batch = _admit(engine, bs, context, need, params, rng)
            worker.force(K)
            log = worker.stats["round_log"]
            log.clear()
            while sum(1 for b, *_ in log if b == bs) < warmup + iters:
                if any(r.status is Status.FINISHED for r in batch):
                    raise RuntimeError(f"a cost-profile request finished inside its cell (bs {bs}, budget {K})")
                engine.step()
            rounds = [(tier, seconds) for b, _, tier, _, seconds, _ in log if b == bs][warmup:]
            verified = None if K == "decode" else min(K, bs * G)
            cells.append({"bs": bs, "K": verified, "M": bs + (verified or 0), "tier": rounds[-1][0],
                          "seconds": float(np.median([s for _, s in rounds]))})
            if progress is not None:
                progress(i + 1, len(grid))
    finally:
        worker.force(None)
        _drop(engine, batch)
        engine.scheduler.waiting.extend(held)
    return cells


def _admit(engine, bs: int, context: int, need: int, params: SamplingParams, rng) -> list:
    """bs profiling requests of random context-token prompts, prefilled (decoding from here on).
    Each may grow by up to 4 cells' worth, within the context and its share of the KV pool."""
    pool = engine.pool
    share = pool.num_usable_pages // bs * pool.page_size  # tokens each of the bs requests may reserve
    room = min(engine.max_model_len, share) - context - engine.lookahead
    if room < need:
        raise ValueError(f"a cost profile of {bs} requests at context {context} needs {need + context + engine.lookahead} "
                         f"positions each; the context is {engine.max_model_len} and the KV pool holds {share} a request")
    params = dataclasses.replace(params, max_new_tokens=min(4 * need, room))
    ids = [engine.add_request(rng.integers(1, engine.num_tokens, context).tolist(), params,
                              request_id=f"cost-profile-{bs}-{i}") for i in range(bs)]
    reqs = [engine.get_request(i) for i in ids]
    while any(r.status is not Status.DECODE for r in reqs):
        engine.step()
    return reqs


def _drop(engine, batch) -> None:
    for r in batch:
        engine.abort(r.id)
    engine.settle()


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
             # format 2: tables timed since greedy decode rounds run their argmax-only executable
             "method": "loop", "format": 2,
             "kernels": [e.runner.backend, e.runner.norm_backend, e.runner.kv_write_backend], "unroll": e.runner.unroll,
             "dtype": str(e.runner.dtype), "rounds": worker.rounds, "context": context,
             "shapes": worker.tiers.shapes(),  # the compiled (tokens, rows) a round's cost depends on
             "device": e.parallel.device.device_kind, "jax": jax.__version__}
    if e.parallel.tp_size > 1:  # (absent at tp 1, so single-device tables keep their keys)
        facts["tp_size"] = e.parallel.tp_size
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def derive_cost_table(worker, cache_dir: str | Path | None = None, measure: bool = True) -> AdditiveCostTable | None:
    """This device's table for the worker's engine: read from the cache, else profiled over every
    batch-size bucket at a context of a quarter of the model length (at most 256) and fitted.
    measure=False: the cached table or None (it needs no executable, so a start-up can read it
    before compiling anything).

    Over several hosts every process must schedule alike, so all of them take rank 0's table:
    rank 0's cached one, else one profiled on every host at once (the profile's steps are
    collective) and fitted on rank 0."""
    from dspark_jax.engine.model_runner import DEFAULT_CACHE_DIR

    e = worker.engine
    context = min(256, e.max_model_len // 4)
    path = Path(cache_dir or DEFAULT_CACHE_DIR.parent / "tables") / f"{_cache_key(worker, context)}.json"
    table = _read_cached(path)
    hosts = jax.process_count() > 1
    if hosts:
        table = _rank0_table(table)
    if table is not None or not measure:
        return table
    t0 = time.perf_counter()
    report = lambda done, total: log.info("profiling step costs: %d/%d cells", done, total)
    fit = fit_cells(profile_cells(e, e.decode_buckets, context=context, progress=report))
    log.info("cost table derived in %.1f s (R^2 %.3f); cached at %s", time.perf_counter() - t0, fit.r_squared, path)
    table = _rank0_table(fit.table) if hosts else fit.table
    path.parent.mkdir(parents=True, exist_ok=True)
    table.save(path)
    return table


def _read_cached(path: Path) -> AdditiveCostTable | None:
    if not path.exists():
        return None
    try:
        table = AdditiveCostTable.load(path)
    except (OSError, ValueError) as err:
        log.warning("ignoring the cached cost table %s: %s", path, err)
        return None
    log.info("cost table read from %s", path)
    return table


def _rank0_table(table: AdditiveCostTable | None) -> AdditiveCostTable | None:
    """Rank 0's table (or its None) on every process."""
    from dspark_jax.parallel.multihost import broadcast_json

    data = broadcast_json(table.to_dict() if table is not None else None)
    return None if data is None else AdditiveCostTable.from_dict(data)
