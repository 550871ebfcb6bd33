"""`python -m serving.launch`: start the OpenAI-compatible dspark-jax server.

With no arguments it serves the embedded default model on whatever device JAX finds, with its
embedded DSpark drafter.

    python -m serving.launch --model-path ./qwen3 --port 30000
    python -m serving.launch --model-path ./qwen3 --draft-model-path ./dspark \\
        --verify-mode compact --sps-table-path sps.json
    python -m serving.launch --model-path ./qwen3 --draft-model-path ./mtp \\
        --speculative-algorithm MTP --mtp-steps 3          # the EAGLE 3-1-4 baseline arm

Start-up compiles every executable the engine runs (unless --no-precompile): a log line per
executable (done of total, elapsed, time left), and on a terminal a progress bar as well.  XLA's
C++ INFO/WARNING lines (TF_CPP_MIN_LOG_LEVEL=2 unless set) and JAX's "Unable to initialize
backend" lines for platforms nobody asked for are left out; errors are not.

SIGTERM / Ctrl-C: stop accepting connections, let in-flight requests run for up to
--shutdown-timeout seconds, then end the rest with finish_reason "abort".  If the engine itself
fails, every request in flight gets a 500 naming the cause and the process exits with status 1,
so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

from dspark_jax.errors import DsparkError
from dspark_jax.server_args import ServerArgs

log = logging.getLogger("serving")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m serving.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(ap)
    return ap


_BACKEND_LINE = re.compile(r"Unable to initialize backend '([^']+)'")


def _requested_backend_or_other(record: logging.LogRecord) -> bool:
    """Drop JAX's note that a platform nobody asked for (tpu, cuda on a CPU host) is absent."""
    m = _BACKEND_LINE.match(record.getMessage())
    asked = {p.strip().lower() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()}
    return m is None or m.group(1).lower() in asked


def quiet_backend_noise() -> None:
    """Call before jax is imported: XLA's C++ INFO and WARNING lines off unless the caller set
    TF_CPP_MIN_LOG_LEVEL (errors still print), and JAX's absent-backend lines filtered out."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.getLogger("jax._src.xla_bridge").addFilter(_requested_backend_or_other)


class CompileProgress:
    """compile_engines' progress(done, total, label): announces the work, then a tqdm bar (elapsed,
    time left, the last executable done) when stderr is a terminal; the engine logs a line per
    executable either way."""

    def __init__(self, engine, bar: bool):
        self.engine = engine
        self.use_bar = bar
        self.bar = None

    @property
    def what(self) -> str:
        """The executables compiled before serving, by kind, as the worker runs them now (read
        when compiling starts: a cached cost table may have ruled the speculative steps out)."""
        from dspark_jax.engine.startup import startup_executables

        kinds = collections.Counter(" ".join(w for w in label.split() if "=" not in w)
                                    for label, _ in startup_executables(self.engine)[0])
        return ", ".join(f"{n} {k}" for k, n in kinds.items())

    def __call__(self, done: int, total: int, label: str | None) -> None:
        if done == 0:
            log.info("compiling %d executables (%s) on %d threads; cached ones load fast", total, self.what,
                     max(1, min(total, os.cpu_count() or 1)))
            if self.use_bar and total:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="compiling", unit="exe", file=sys.stderr, dynamic_ncols=True)
            return
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
            if done == total:
                self.bar.close()


def build_engine(args: ServerArgs):
    """The engine of resolved args, its executables compiled with progress shown, and (DSpark
    compact) its cost table derived or read from the cache."""
    if not args.precompile:
        return args.build_engine()
    engine = dataclasses.replace(args, precompile=False).build_engine()  # prepared here instead
    bar = sys.stderr.isatty() and log.isEnabledFor(logging.INFO)
    progress = CompileProgress(engine, bar)
    redirect = contextlib.nullcontext()
    if bar:
        from tqdm.contrib.logging import logging_redirect_tqdm

        redirect = logging_redirect_tqdm()  # log lines above the bar, not through it
    with redirect:  # (a compact DSpark engine also derives or reads its cost table here)
        engine.prepare(progress)
    return engine


def make_server(app, *, host: str, port: int, log_level: str = "info", shutdown_timeout: float = 30.0):
    """A uvicorn Server whose SIGTERM/SIGINT first puts the app into draining mode."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.server.begin_drain()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout + 5)
    return DrainingServer(config)


def main(argv=None) -> int:
    quiet_backend_noise()
    ap = build_parser()
    try:
        args = ServerArgs.from_namespace(ap.parse_args(argv)).resolve()
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    try:
        args.init_distributed()  # --nnodes > 1: join the other hosts before JAX starts
    except ValueError as e:  # e.g. nodes started with different engine flags
        ap.error(str(e))
    import jax

    from serving.app import ServerConfig, create_app

    log.info("loading %s (%s) on %s (tp %d, dp %d)", args.model_path, args.speculative_algorithm, jax.devices()[0],
             args.tp_size, args.dp_size)
    host_replicas = args.nnodes > 1 and args.dp_size > 1
    try:
        if host_replicas:  # this host's replicas of dp_size spread over the hosts
            replicas = args.build_host_replicas()
            engines = list(replicas.values())
        else:
            engines = [build_engine(args)] if args.dp_size == 1 else args.build_engines()
    except (ValueError, OSError, DsparkError) as e:
        ap.error(str(e))
    if args.nnodes == 1:  # one host (engines spread over several hosts compile on first use)
        # Traffic may ask for logprobs or penalties at once: the steps that hold any such batch
        # start compiling now, in the background, rather than on the first request that needs one.
        for replica in engines:
            replica.worker.warm_processed()
    engine = engines[0]
    if host_replicas:  # rank 0 serves and routes to every host's replicas; the others follow
        from dspark_jax.parallel.host_replicas import HostReplicas, follow_replicas

        if args.node_rank != 0:
            log.info("rank %d running replicas %s under rank 0", args.node_rank, sorted(replicas))
            follow_replicas(replicas)
            return 0
        engines = [engine := HostReplicas(replicas, args.dp_size)]
    elif args.nnodes > 1:  # one engine over every host: rank 0 serves and leads, the others follow
        from dspark_jax.parallel.multihost import LeaderEngine, follow

        if args.node_rank != 0:
            log.info("rank %d following rank 0's steps", args.node_rank)
            follow(engine)
            return 0
        engines = [engine := LeaderEngine(engine)]
    log.info("%d engine replica(s) ready in %.1f s (compile %.1f s)", len(engines), time.perf_counter() - t0,
             engine.compile_seconds)
    # what the engine runs: a DSpark engine whose measured table rules speculation out serves plain steps
    algorithm = args.speculative_algorithm if engine.worker.name != "none" else "NONE"
    extra = {}
    if algorithm == "MTP":
        extra = {"speculative_num_steps": engine.worker.num_steps,
                 "speculative_num_draft_tokens": engine.worker.num_steps + 1}
    elif algorithm != args.speculative_algorithm:
        extra = {"speculative_algorithm_requested": args.speculative_algorithm}
    cfg = ServerConfig(
        model_name=args.served_model_name or Path(args.model_path).name, model_path=str(args.model_path),
        draft_model_path=args.draft_model_path if algorithm != "NONE" else None, speculative_algorithm=algorithm,
        verify_mode=args.verify_mode if algorithm == "DSPARK" else None,
        block_size=getattr(engine.worker, "gamma", None), shutdown_timeout=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes, default_chat_max_tokens=args.default_chat_max_tokens,
        extra=extra,
    )
    app = create_app(engines if len(engines) > 1 else engine, cfg)
    server = make_server(app, host=args.host, port=args.port, log_level=args.log_level,
                         shutdown_timeout=args.shutdown_timeout)
    state = app.state.server
    state.on_fatal = lambda err: setattr(server, "should_exit", True)
    log.info("serving %r on http://%s:%d", cfg.model_name, args.host, args.port)
    # uvicorn re-raises a captured SIGTERM/SIGINT after its graceful shutdown, restoring the
    # previous handlers first: with these no-op handlers a drained shutdown exits with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if args.nnodes > 1:
        engine.close()  # the followers return
    if state.fatal_error is not None:
        log.error("the engine failed: %r", state.fatal_error)
        return 1
    log.info("shut down cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
