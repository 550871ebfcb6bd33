"""Synthetic DSpark rounds, for studies: one compiled round dispatched again and again on a steady
made-up batch, to time the executable alone (benchmarks/profile_sps.py --method device) or to
trace it (benchmarks/profile_round.py).  The serving loop never runs them: the cost table the
scheduler reads is profiled in the loop itself (spec/dspark/profile.py)."""

from __future__ import annotations

import bisect
import contextlib
import time

import jax
import numpy as np

from dspark_jax.spec.dspark.step import SpecInputs, decode_mode


@contextlib.contextmanager
def synthetic_round(worker, batch_size: int, budget: int | None, context: int, sampling=(0.0, 0, 1.0)):
    """(tier, call): ``call()`` dispatches the worker's compiled round once on batch_size
    requests whose anchors sit at ``context``, verifying ``budget`` drafts beyond them (the
    compact executable; None: a plain decode step), sampling = (temperature, top_k, top_p), and
    returns its device results.  Nothing is committed; the pages are given back on exit."""
    e = worker.engine
    mode = "compact" if budget is not None else decode_mode(sampling[0])
    tiers = worker.tiers
    T = (tiers.tier_for(batch_size, budget) if budget is not None else
         tiers.batch_sizes[bisect.bisect_left(tiers.batch_sizes, batch_size)])
    S, P = (tiers.rows_for(T, batch_size) if budget is not None else T), e.pages_per_seq
    owners = [("synthetic_round", i) for i in range(batch_size)]
    table = np.zeros((S, P), np.int32)
    try:
        for i, owner in enumerate(owners):
            e.pool.reserve(owner, context + worker.lookahead)
            table[i] = e.pool.page_table_row(owner, P)
        live = np.arange(S) < batch_size
        temperature, top_k, top_p = sampling
        row = lambda x, pad, dt: np.where(live, x, pad).astype(dt)  # noqa: E731
        inp = SpecInputs(anchor=row(5, 0, np.int32), start=row(context, 0, np.int32), page_table=table, live=live,
                         num_seqs=np.int32(batch_size), budget=np.full(worker.rounds, budget or 0, np.int32),
                         temperature=row(temperature, 0, np.float32), top_k=row(top_k, 0, np.int32),
                         top_p=row(top_p, 1, np.float32), seed=np.arange(S, dtype=np.uint32),
                         logit_slot=np.full(S, -1, np.int32), fed_anchor=None, fed_start=None,
                         fed_index=np.full(S, -1, np.int32))
        yield T, worker.round_caller(mode, T, S, P, inp)
    finally:
        for owner in owners:
            e.pool.free(owner)


def time_round(worker, batch_size: int, budget: int | None, context: int, sampling=(0.0, 0, 1.0), iters: int = 10,
               warmup: int = 3) -> tuple[int, float]:
    """(tier, median seconds per round) of synthetic_round's call over chains of calls dispatched
    back to back: device time or dispatch, whichever bounds it, without the loop's host work."""
    with synthetic_round(worker, batch_size, budget, context, sampling) as (T, call):
        def chain(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                results = call()
            jax.block_until_ready(results)
            return (time.perf_counter() - t0) / n

        chain(warmup)
        times = [chain(iters) for _ in range(3)]
    return T, float(np.median(times)) / worker.rounds
