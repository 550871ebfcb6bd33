"""Command-line batch generation.

    python -m dspark_jax.generate --model-path DIR --prompt "Hello" --max-new-tokens 32 --json

    python -m dspark_jax.generate --prompt "Hello" --speculative mtp --draft-model-path MTP_DIR --mtp-steps 3

With --json, one JSON object per prompt is printed on its own line, in prompt order, holding
token_ids (generated ids only), text, finish_reason and timing stats; with --speculative (dspark
or mtp) the stats carry the same per-request "spec" block (verify_ct, accept lengths, windows).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from dspark_jax.errors import DsparkError


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="Hugging Face Qwen3 folder (default: the embedded model)")
    # Both append to one list so mixed --prompt / --prompt-ids keep their command-line order.
    ap.add_argument("--prompt", dest="prompts", action="append", default=[], help="prompt text (repeatable)")
    ap.add_argument("--prompt-ids", dest="prompts", action="append", type=_ids, help="raw token ids, e.g. 1,2,3 (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--max-running-requests", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "pallas", "reference"])
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--no-precompile", action="store_true", help="compile shape buckets on first use instead of at start-up")
    ap.add_argument("--speculative", default="none", choices=["none", "dspark", "mtp"],
                    help="speculative decoding: dspark (block drafter) or mtp (EAGLE-style chain drafter, the baseline)")
    ap.add_argument("--draft-model-path", default=None,
                    help="drafter folder: the DSpark drafter for dspark, the MTP drafter (save_mtp) for mtp "
                         "(default with the embedded model: its embedded drafter of that kind)")
    ap.add_argument("--mtp-steps", type=int, default=None,
                    help="MTP chain length k (SGLang 3-1-4 is k = 3: 3 drafts, 4 verify tokens); "
                         "default: the drafter folder's speculative.json, else 3")
    ap.add_argument("--verify-mode", default="static", choices=["static", "compact", "cap-accept"])
    ap.add_argument("--block-size", type=int, default=None, help="must equal the drafter's trained block size")
    ap.add_argument("--sps-table-path", default=None, help="additive step-cost table JSON (none: verify everything)")
    ap.add_argument("--sps-level-correction", type=float, default=None, metavar="WEIGHT",
                    help="learn the cost table's level from measured rounds with this moving-average weight in "
                         "(0, 1], e.g. 0.1 (needs --sps-table-path; windows then follow wall-clock timing, so a "
                         "seeded T > 0 run is not reproducible)")
    ap.add_argument("--sps-min-gain", type=float, default=None, metavar="G",
                    help="trim only when the predicted throughput beats verify-all by this fraction (>= 0; "
                         "default 0.04, SpeculativeConfig.min_predicted_gain)")
    ap.add_argument("--rounds-per-call", type=int, default=None, metavar="N",
                    help="DSpark rounds per dispatched executable (default 1): the host's work per round split "
                         "n ways, for a loop the host paces (on the H200 at n = 2: 1.16-1.36x at batch 1, "
                         "1.20-1.44x at batch 8 (T=0), 1.03-1.27x at batch 64 (T=1), benchmarks/results/"
                         "speculative_default_gpu_bs{1,8}_t0_r1_vs_r2_75b3210.md, ..._bs64_t1_r2_paired_5c988af.md); each round "
                         "executable then compiles n rounds unrolled")
    ap.add_argument("--sts-path", default=None, help="STS temperatures JSON (default: the drafter folder's "
                    "sts.json if it has one, else identity)")
    ap.add_argument("--record-sts-dir", default=None,
                    help="write STS calibration data (raw confidence logits, accepted drafts) here; "
                         "needs --verify-mode static or cap-accept and no --sts-path")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    prompts = list(args.prompts)
    if not prompts:
        print("error: give at least one --prompt or --prompt-ids", file=sys.stderr)
        return 2
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.sampling import SamplingParams

    model_path = args.model_path
    if model_path is None:
        from dspark_jax.default_model import default_model_path

        model_path = default_model_path()
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    try:
        params.validate()
        ec = EngineConfig(
            max_running_requests=args.max_running_requests,
            max_model_len=args.max_model_len,
            attention_backend=args.attention_backend,
            dtype=args.dtype,
            precompile=not args.no_precompile,
        )
        if args.mtp_steps is not None and args.speculative != "mtp":
            raise ValueError("--mtp-steps needs --speculative mtp")
        if args.speculative == "dspark":
            engine = _speculative_engine(args, model_path, ec)
        elif args.speculative == "mtp":
            engine = _mtp_engine(args, model_path, ec)
        else:
            engine = Engine.from_pretrained(model_path, ec)
        results = engine.generate(prompts, params)
        if hasattr(engine, "flush_records"):
            engine.flush_records()
    except (DsparkError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for r in results:
        if args.json:
            print(json.dumps({"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                              "prompt_tokens": len(r.prompt_token_ids), "stats": r.stats}), flush=True)
        else:
            print(f"--- {r.finish_reason} ({len(r.token_ids)} tokens)\n{r.text}")
    if not args.json:
        s = engine.last_generate_stats
        print(f"\n{s['completion_tokens']} tokens in {s['wall_s']:.2f}s ({s['tokens_per_s']:.1f} tok/s)", file=sys.stderr)
    return 0


def _drafter_folder(args, embedded, what: str):
    """--draft-model-path, else the embedded drafter (embedded(): a path or None), which belongs to
    the embedded target only."""
    from dspark_jax.errors import CheckpointError

    draft = args.draft_model_path or (embedded() if args.model_path is None else None)
    if draft is None:
        raise CheckpointError(f"--speculative {args.speculative} needs --draft-model-path, {what} (the embedded "
                              "one only serves the embedded default model)")
    return draft


def _speculative_engine(args, model_path, ec):
    from dspark_jax.calibration.sts import StsCalibration
    from dspark_jax.default_model import default_drafter_path
    from dspark_jax.spec.dspark.engine import SpeculativeConfig, SpeculativeEngine
    from dspark_jax.spec.dspark.cost_model import load_cost_table

    draft = _drafter_folder(args, default_drafter_path, "a DSpark drafter folder")

    # No --sts-path: from_pretrained uses the drafter folder's own calibration (raw confidences
    # when recording).
    spec = SpeculativeConfig(
        mode=args.verify_mode,
        sts=StsCalibration.load(args.sts_path) if args.sts_path else None,
        cost_table=load_cost_table(args.sps_table_path),
        record_sts_dir=args.record_sts_dir,
        step_time_correction=level_correction(args.sps_level_correction, args.sps_table_path),
        **min_gain(args.sps_min_gain),
        **rounds_per_call(args.rounds_per_call),
    )
    return SpeculativeEngine.from_pretrained(model_path, draft, ec, spec, block_size=args.block_size)


def level_correction(weight: float | None, table_path) -> float | None:
    """--sps-level-correction, checked: a weight in (0, 1] that only means something with a table."""
    if weight is None:
        return None
    if not 0 < weight <= 1:
        raise ValueError(f"--sps-level-correction must be in (0, 1], got {weight}")
    if table_path is None:
        raise ValueError("--sps-level-correction corrects a cost table: pass --sps-table-path")
    return weight


def min_gain(gain: float | None) -> dict:
    """--sps-min-gain, checked, as SpeculativeConfig keyword arguments (none given: its default)."""
    if gain is None:
        return {}
    if not gain >= 0:
        raise ValueError(f"--sps-min-gain must be >= 0, got {gain}")
    return {"min_predicted_gain": float(gain)}


def rounds_per_call(n: int | None) -> dict:
    """--rounds-per-call, checked, as SpeculativeConfig keyword arguments (none given: its default)."""
    if n is None:
        return {}
    if n < 1:
        raise ValueError(f"--rounds-per-call must be >= 1, got {n}")
    return {"rounds_per_call": int(n)}


def dspark_only_flags(args) -> list[str]:
    """The DSpark-only options set in ``args`` (the CLI's or the server's; the server has no
    --record-sts-dir), for the error when another algorithm is chosen."""
    given = (("--verify-mode", args.verify_mode != "static"), ("--block-size", args.block_size),
             ("--sps-table-path", args.sps_table_path), ("--sts-path", args.sts_path),
             ("--record-sts-dir", getattr(args, "record_sts_dir", None)),
             ("--sps-level-correction", args.sps_level_correction), ("--sps-min-gain", args.sps_min_gain is not None),
             ("--rounds-per-call", args.rounds_per_call is not None))
    return [flag for flag, set_ in given if set_]


def _mtp_engine(args, model_path, ec):
    from dspark_jax.default_model import default_mtp_path
    from dspark_jax.spec.mtp.engine import MTPEngine

    draft = _drafter_folder(args, default_mtp_path, "an MTP drafter folder")
    dspark_only = dspark_only_flags(args)
    if dspark_only:
        raise ValueError(f"{', '.join(dspark_only)}: DSpark options, not used by --speculative mtp")
    return MTPEngine.from_pretrained(model_path, draft, ec, num_steps=args.mtp_steps)


if __name__ == "__main__":
    sys.exit(main())
