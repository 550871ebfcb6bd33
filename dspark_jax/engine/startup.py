"""What an engine is built from and compiled with at start-up: the worker a drafter calls for,
the executables it needs before serving (on the GPU the widest of each kind, the rest queued in
the background), and those of several engines compiled at once, on all of a GPU host's cores."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time

from dspark_jax.engine.worker import PlainWorker, Worker

log = logging.getLogger(__name__)


def make_worker(drafter=None, spec=None) -> Worker:
    """The worker of a drafter (DSpark or MTP, by its type), or the plain one."""
    if drafter is None:
        if spec is not None:
            raise ValueError("a speculative config needs a drafter")
        return PlainWorker()
    from dspark_jax.spec.config import SpeculativeConfig
    from dspark_jax.spec.dspark.model import DSparkDrafter
    from dspark_jax.spec.mtp.model import MTPDrafter

    if isinstance(drafter, DSparkDrafter):
        from dspark_jax.spec.dspark.worker import DSparkWorker

        return DSparkWorker(drafter, spec or SpeculativeConfig())
    if isinstance(drafter, MTPDrafter):
        from dspark_jax.spec.mtp.worker import MTPWorker

        return MTPWorker(drafter, spec or SpeculativeConfig(algorithm="mtp"))
    raise TypeError(f"unknown drafter type {type(drafter).__name__}")


def compile_engines(engines, progress=None, *, widest_first: bool = False) -> float:
    """Compile every executable the engines' workers run, several at a time on a GPU host (XLA
    compiles outside the GIL, so the host's cores share the work), logging progress; returns
    seconds spent.  widest_first: as a start-up does, only the executables each engine needs
    before it serves (startup_executables), the rest then queued in its background.
    progress(done, total, label), if given, is called with (0, total, None) first, then as each
    executable is compiled (e.g. to draw a progress bar)."""
    plans = [startup_executables(e) if widest_first else (e.executables(), []) for e in engines]
    todo = [item for now, _ in plans for item in now]
    t0 = time.perf_counter()
    if progress is not None:
        progress(0, len(todo), None)
    # On the CPU one thread builds them all, a guard against XLA:CPU's aborts in the persistent
    # cache read that has not stopped them (model_runner.py, docs/decisions.md).
    cpu = any(getattr(e.runner, "platform", None) == "cpu" for e in engines)
    threads = 1 if cpu else max(1, min(len(todo), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool:
        futures = {pool.submit(build): label for label, build in todo}
        for i, done in enumerate(concurrent.futures.as_completed(futures), 1):
            done.result()
            spent = time.perf_counter() - t0
            log.info("compiled %d/%d (%s) at %.0f s, about %.0f s left", i, len(todo), futures[done], spent,
                     spent / i * (len(todo) - i))
            if progress is not None:
                progress(i, len(todo), futures[done])
    for e in engines:
        e.runner.take_compile_spans()
    spent = time.perf_counter() - t0
    for e, (_, later) in zip(engines, plans):
        queue_in_background(e, later)
    return spent


def queue_in_background(engine, executables) -> None:
    """Queue these (label, compile thunk) on the engine's background compile thread; those
    compiled or queued already are skipped."""
    if not executables:
        return
    queued = engine.background.queue(build for _, build in executables)
    log.info("%d more executables compile in the background; until each is ready, its steps run "
             "padded on a wider one", queued)


def startup_executables(engine) -> tuple[list, list]:
    """(label, compile thunk) of the executables a start-up compiles before serving, and of those
    it then queues on the background compile thread.  Where the engine compiles its widest first,
    before serving come the widest of each kind (a step of any batch runs padded on it) and the
    logit processors'; else all, and nothing after.  A cost table still to be derived profiles
    every tier on its own executable with greedy requests, so then all come first but the
    narrower executables only sampled batches run, which the start-up queues once the profile
    is done (Engine.prepare)."""
    if not engine.widest_first:
        return engine.executables(), []
    worker = engine.worker
    processors = engine.processors.executables() if engine.processors else []
    widest = worker.widest(processed=False)
    if getattr(worker, "needs_calibration", False):
        return worker.executables([k for k in worker.keys() if k in widest or not worker.sampled_only(k)]) + processors, []
    # the widest processed steps head the queue: a request with logprobs or penalties then
    # waits for nothing else to load; then the narrowest first, whose batches pad the most
    later = worker.executables(worker.widest(processed=True)) if worker.pads(True) else []
    return worker.executables(widest) + processors, later + worker.executables(worker.keys()[::-1])
