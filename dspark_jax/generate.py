"""Command-line batch generation.

    python -m dspark_jax.generate --model-path DIR --prompt "Hello" --max-new-tokens 32 --json

With --json, one JSON object per prompt is printed on its own line, in prompt order, holding
token_ids (generated ids only), text, finish_reason and timing stats.
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
    ap.add_argument("--speculative", default="none", choices=["none", "dspark"],
                    help="speculative decoding algorithm (the MTP arm is not wired into the engine yet)")
    ap.add_argument("--draft-model-path", default=None, help="DSpark drafter folder")
    ap.add_argument("--verify-mode", default="static", choices=["static", "compact", "cap-accept"])
    ap.add_argument("--block-size", type=int, default=None, help="must equal the drafter's trained block size")
    ap.add_argument("--sps-table-path", default=None, help="additive step-cost table JSON (none: verify everything)")
    ap.add_argument("--sts-path", default=None, help="STS temperatures JSON (none: identity)")
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
        )
        if args.speculative == "dspark":
            engine = _speculative_engine(args, model_path, ec)
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


def _speculative_engine(args, model_path, ec):
    from dspark_jax.calibration.sts import StsCalibration
    from dspark_jax.engine.speculative import SpeculativeConfig, SpeculativeEngine
    from dspark_jax.errors import CheckpointError
    from dspark_jax.speculative.cost_model import load_cost_table

    draft = args.draft_model_path
    if draft is None:
        from dspark_jax.default_model import default_drafter_path

        draft = default_drafter_path()
        if draft is None:
            raise CheckpointError("--speculative dspark needs --draft-model-path (no embedded drafter is shipped yet)")
    spec = SpeculativeConfig(
        mode=args.verify_mode,
        sts=StsCalibration.load(args.sts_path) if args.sts_path else None,
        cost_table=load_cost_table(args.sps_table_path),
        record_sts_dir=args.record_sts_dir,
    )
    return SpeculativeEngine.from_pretrained(model_path, draft, ec, spec, block_size=args.block_size)


if __name__ == "__main__":
    sys.exit(main())
