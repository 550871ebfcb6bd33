"""`python -m serving.launch`: start the OpenAI-compatible dspark-jax server.

With no arguments it serves the embedded default model on whatever device JAX finds: with its
DSpark drafter when one is shipped (dspark_jax/default_model.py), else non-speculatively (logged).

    python -m serving.launch --model-path ./qwen3 --port 30000
    python -m serving.launch --model-path ./qwen3 --draft-model-path ./dspark \\
        --speculative-algorithm DSPARK --verify-mode compact --sps-table-path sps.json
    python -m serving.launch --model-path ./qwen3 --draft-model-path ./mtp \\
        --speculative-algorithm MTP --mtp-steps 3          # the EAGLE 3-1-4 baseline arm

SIGTERM / Ctrl-C: stop accepting connections, let in-flight requests run for up to
--shutdown-timeout seconds, then end the rest with finish_reason "abort".
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

log = logging.getLogger("serving")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m serving.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="Hugging Face Qwen3 folder (default: the embedded default model)")
    ap.add_argument("--served-model-name", help="name clients pass as 'model' (default: the folder name)")
    ap.add_argument("--draft-model-path", help="drafter folder: a DSpark drafter, or an MTP drafter for --speculative-algorithm "
                                               "MTP (default with the embedded model: its embedded drafter of that kind)")
    ap.add_argument("--speculative-algorithm", choices=["NONE", "DSPARK", "MTP"], default=None,
                    help="DSPARK: DSpark block drafting; MTP: the EAGLE-style chain drafter (the baseline arm); "
                         "NONE: plain decoding. Default: the kind of --draft-model-path when given, DSPARK for the "
                         "embedded model with its embedded drafter, else NONE.")
    ap.add_argument("--mtp-steps", type=int, help="MTP chain length k (SGLang 3-1-4 is k = 3); default: the drafter "
                                                  "folder's speculative.json, else 3")
    ap.add_argument("--verify-mode", choices=["static", "compact", "cap-accept"], default="static",
                    help="DSpark verify mode (SGLANG_RAGGED_VERIFY_MODE)")
    ap.add_argument("--block-size", type=int, help="DSpark block size; must equal the drafter's trained block size")
    ap.add_argument("--sps-table-path", help="SPS cost table JSON (compact mode budget); default: verify everything")
    ap.add_argument("--sps-level-correction", type=float, metavar="WEIGHT",
                    help="learn the cost table's level from measured rounds (moving-average weight in (0, 1], "
                         "e.g. 0.1; needs --sps-table-path; seeded T > 0 output then follows timing)")
    ap.add_argument("--sps-min-gain", type=float, metavar="G",
                    help="trim only when the predicted throughput beats verify-all by this fraction (>= 0; "
                         "default 0.04)")
    ap.add_argument("--rounds-per-call", type=int, metavar="N",
                    help="DSpark rounds per dispatched executable (default 1; on the H200 2 ran 1.16-1.36x faster at "
                         "batch 1, 1.20-1.44x at batch 8, 1.03-1.27x at batch 64; each executable holds N rounds "
                         "unrolled, so it compiles longer); tokens then stream N rounds at a time")
    ap.add_argument("--sts-path", help="STS confidence calibration JSON; default: the drafter folder's sts.json "
                    "if it has one, else identity temperatures")
    ap.add_argument("--max-running-requests", type=int, default=16, help="decode slots (continuous batching)")
    ap.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (rounded up to pages); default: every slot can hold a full context")
    ap.add_argument("--max-model-len", type=int, help="context length (default: min(model max positions, 4096))")
    ap.add_argument("--max-prefill-tokens", type=int, default=512, help="prefill chunk token budget per step")
    ap.add_argument("--page-size", type=int, default=16, help="KV page size in tokens")
    ap.add_argument("--admit-batch", type=int, default=1, metavar="N",
                    help="admit waiting requests only once N slots are free (or all waiting fit), at most 8 steps "
                         "late: each admission drains the overlapped decode loop, so fewer, larger admissions "
                         "cost less (default 1: admit on every free slot)")
    ap.add_argument("--no-precompile", action="store_true", help="compile shape buckets on first use instead of at start-up")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    ap.add_argument("--log-level", default="info")
    return ap


def resolve(args, ap) -> dict:
    """Fill defaults (model, drafter, algorithm); exit with a clear message on an impossible combination."""
    from dspark_jax.default_model import default_drafter_path, default_model_path, default_mtp_path

    if args.admit_batch < 1:
        ap.error(f"--admit-batch must be >= 1, got {args.admit_batch}")
    using_default = args.model_path is None
    model_path = Path(args.model_path) if args.model_path else default_model_path()
    draft = args.draft_model_path or (default_drafter_path() if using_default else None)
    algo = args.speculative_algorithm or (("MTP" if _is_mtp_folder(draft) else "DSPARK") if draft else "NONE")
    if algo == "DSPARK" and draft is None:
        ap.error("--speculative-algorithm DSPARK needs a drafter: pass --draft-model-path "
                 "(no DSpark drafter is shipped for the default model yet)")
    if algo == "MTP":
        draft = args.draft_model_path or (default_mtp_path() if using_default else None)
        if draft is None:
            ap.error("--speculative-algorithm MTP needs --draft-model-path, an MTP drafter folder "
                     "(the embedded one only serves the embedded default model)")
        from dspark_jax.generate import dspark_only_flags

        dspark_only = dspark_only_flags(args)
        if dspark_only:
            ap.error(f"{', '.join(dspark_only)}: DSpark options, not used by --speculative-algorithm MTP")
    elif args.mtp_steps is not None:
        ap.error("--mtp-steps needs --speculative-algorithm MTP")
    if algo == "NONE":
        if args.draft_model_path:
            ap.error("--draft-model-path given with --speculative-algorithm NONE")
        draft = None
        if using_default and default_drafter_path() is None:
            log.info("no DSpark drafter is shipped for the embedded default model yet: serving it non-speculatively")
    if algo == "DSPARK":
        from dspark_jax.generate import level_correction, min_gain, rounds_per_call

        try:
            level_correction(args.sps_level_correction, args.sps_table_path)
            min_gain(args.sps_min_gain)
            rounds_per_call(args.rounds_per_call)
        except ValueError as e:
            ap.error(str(e))
    return {"model_path": model_path, "draft": Path(draft) if draft else None, "algo": algo}


def _is_mtp_folder(folder) -> bool:
    """A folder written by dspark_jax.spec.mtp.model.save_mtp (config.json with model_type dspark_mtp)."""
    import json

    from dspark_jax.spec.mtp.model import MODEL_TYPE

    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def build_engine(args, r: dict):
    from dspark_jax.engine.engine import Engine, EngineConfig

    num_pages = None
    if args.max_total_tokens:
        num_pages = -(-args.max_total_tokens // args.page_size) + 1  # + the sentinel page
    ec = EngineConfig(max_running_requests=args.max_running_requests, max_model_len=args.max_model_len,
                      page_size=args.page_size, num_pages=num_pages, max_prefill_tokens=args.max_prefill_tokens,
                      precompile=not args.no_precompile, admit_batch=args.admit_batch)
    if r["algo"] == "NONE":
        return Engine.from_pretrained(r["model_path"], ec)
    if r["algo"] == "MTP":
        from dspark_jax.spec.mtp.engine import MTPEngine

        return MTPEngine.from_pretrained(r["model_path"], r["draft"], ec, num_steps=args.mtp_steps)
    from dspark_jax.calibration.sts import StsCalibration
    from dspark_jax.spec.dspark.engine import SpeculativeConfig, SpeculativeEngine
    from dspark_jax.generate import level_correction, min_gain, rounds_per_call
    from dspark_jax.spec.dspark.cost_model import load_cost_table

    spec = SpeculativeConfig(mode=args.verify_mode, cost_table=load_cost_table(args.sps_table_path),
                             sts=StsCalibration.load(args.sts_path) if args.sts_path else None,  # else the folder's
                             step_time_correction=level_correction(args.sps_level_correction, args.sps_table_path),
                             **min_gain(args.sps_min_gain), **rounds_per_call(args.rounds_per_call))
    return SpeculativeEngine.from_pretrained(r["model_path"], r["draft"], ec, spec, block_size=args.block_size)


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
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    r = resolve(args, ap)
    from serving.app import ServerConfig, create_app

    t0 = time.perf_counter()
    import jax

    log.info("loading %s (%s) on %s", r["model_path"], r["algo"], jax.devices()[0])
    engine = build_engine(args, r)
    log.info("engine ready in %.1f s (compile %.1f s)", time.perf_counter() - t0, getattr(engine, "compile_seconds", 0.0))
    cfg = ServerConfig(
        model_name=args.served_model_name or r["model_path"].name, model_path=str(r["model_path"]),
        draft_model_path=str(r["draft"]) if r["draft"] else None, speculative_algorithm=r["algo"],
        verify_mode=args.verify_mode if r["algo"] == "DSPARK" else None,
        block_size=getattr(engine, "gamma", None), shutdown_timeout=args.shutdown_timeout,
        extra={"speculative_num_steps": engine.num_steps, "speculative_num_draft_tokens": engine.num_steps + 1}
        if r["algo"] == "MTP" else {},
    )
    app = create_app(engine, cfg)
    server = make_server(app, host=args.host, port=args.port, log_level=args.log_level,
                         shutdown_timeout=args.shutdown_timeout)
    log.info("serving %r on http://%s:%d", cfg.model_name, args.host, args.port)
    # uvicorn re-raises a captured SIGTERM/SIGINT after its graceful shutdown, restoring the
    # previous handlers first: with these no-op handlers a drained shutdown exits with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    log.info("shut down cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
