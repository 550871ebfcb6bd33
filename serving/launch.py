"""`python -m serving.launch`: start the OpenAI-compatible dspark-jax server.

With no arguments it serves the embedded default model on whatever device JAX finds, with its
embedded DSpark drafter.

    python -m serving.launch --model-path ./qwen3 --port 30000
    python -m serving.launch --model-path ./qwen3 --draft-model-path ./dspark \\
        --verify-mode compact --sps-table-path sps.json
    python -m serving.launch --model-path ./qwen3 --draft-model-path ./mtp \\
        --speculative-algorithm MTP --mtp-steps 3          # the EAGLE 3-1-4 baseline arm

SIGTERM / Ctrl-C: stop accepting connections, let in-flight requests run for up to
--shutdown-timeout seconds, then end the rest with finish_reason "abort".  If the engine itself
fails, every request in flight gets a 500 naming the cause and the process exits with status 1,
so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import logging
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
    ap = build_parser()
    try:
        args = ServerArgs.from_namespace(ap.parse_args(argv)).resolve()
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from serving.app import ServerConfig, create_app

    t0 = time.perf_counter()
    args.init_distributed()  # --nnodes > 1: join the other hosts before JAX starts
    import jax

    log.info("loading %s (%s) on %s (tp %d, dp %d)", args.model_path, args.speculative_algorithm, jax.devices()[0],
             args.tp_size, args.dp_size)
    try:
        engines = args.build_engines()
    except (ValueError, OSError, DsparkError) as e:
        ap.error(str(e))
    engine = engines[0]
    if args.nnodes > 1:  # one engine over every host: rank 0 serves and leads, the others follow
        from dspark_jax.parallel.multihost import LeaderEngine, follow

        if args.node_rank != 0:
            log.info("rank %d following rank 0's steps", args.node_rank)
            follow(engine)
            return 0
        engines = [engine := LeaderEngine(engine)]
    log.info("%d engine replica(s) ready in %.1f s (compile %.1f s)", len(engines), time.perf_counter() - t0,
             engine.compile_seconds)
    cfg = ServerConfig(
        model_name=args.served_model_name or Path(args.model_path).name, model_path=str(args.model_path),
        draft_model_path=args.draft_model_path, speculative_algorithm=args.speculative_algorithm,
        verify_mode=args.verify_mode if args.speculative_algorithm == "DSPARK" else None,
        block_size=getattr(engine.worker, "gamma", None), shutdown_timeout=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes, default_chat_max_tokens=args.default_chat_max_tokens,
        extra={"speculative_num_steps": engine.worker.num_steps,
               "speculative_num_draft_tokens": engine.worker.num_steps + 1}
        if args.speculative_algorithm == "MTP" else {},
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
