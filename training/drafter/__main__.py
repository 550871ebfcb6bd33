"""Command line: `python -m training.drafter {selfdistill,train,export,evaluate} ...` (see __init__).

Every DrafterTrainConfig field is a `train` option (--steps, --batch-size, --num-anchors, ...);
re-running the same `train` command on an existing run directory resumes it, and re-running
`selfdistill` skips the shards already written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

from training.drafter.config import DrafterTrainConfig
from training.drafter.selfdistill import SelfDistillConfig


def _add_dataclass_options(parser: argparse.ArgumentParser, cls) -> None:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        hint = hints[field.name]
        optional = type(None) in typing.get_args(hint)  # "X | None": the option parses an X
        base = next(t for t in typing.get_args(hint) if t is not type(None)) if optional else hint
        if hint is bool:
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=field.default,
                                metavar="BOOL")
        elif typing.get_origin(base) is tuple:
            parser.add_argument(flag, type=lambda s: tuple(x.strip() for x in s.split(",") if x.strip()),
                                default=field.default, help=f"comma-separated (default: {field.default})")
        else:
            parser.add_argument(flag, type=base, default=field.default, help=f"(default: {field.default})")


def _config(args, cls):
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    if cls is DrafterTrainConfig and kw["target_layer_ids"] is not None:
        kw["target_layer_ids"] = tuple(int(x) for x in kw["target_layer_ids"])
    return cls(**kw)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("selfdistill", help="generate the target's responses to corpus prompts")
    p.add_argument("--target", required=True, type=Path, help="target model folder")
    p.add_argument("--corpus", required=True, type=Path, help="corpus directory (training.corpus.build)")
    p.add_argument("--out", required=True, type=Path, help="dataset directory (the split goes to OUT/<split>)")
    p.add_argument("--max-running", type=int, default=256, help="engine slots (concurrent requests)")
    p.add_argument("--time-limit-s", type=float, help="stop after this long, keeping the finished shards")
    p.add_argument("--no-progress", action="store_true")
    _add_dataclass_options(p, SelfDistillConfig)

    p = sub.add_parser("train", help="train (or resume) a drafter")
    p.add_argument("--target", required=True, type=Path, help="target model folder")
    p.add_argument("--data", required=True, type=Path, help="dataset directory with train/ (and validation/)")
    p.add_argument("--out", required=True, type=Path, help="run directory (created, or resumed)")
    p.add_argument("--stop-at", type=int, help="end this invocation after this step (checkpointed)")
    p.add_argument("--no-progress", action="store_true")
    _add_dataclass_options(p, DrafterTrainConfig)

    p = sub.add_parser("export", help="write a run's drafter folder")
    p.add_argument("--run", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--best", action="store_true", help="the params with the best held-out tau")
    which.add_argument("--step", type=int, help="a checkpoint step (default: the latest)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])

    p = sub.add_parser("evaluate", help="teacher-forced tau per workload of a drafter folder")
    p.add_argument("--target", required=True, type=Path)
    p.add_argument("--drafter", required=True, type=Path)
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("--split", default="validation")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--num-anchors", type=int, default=256)
    p.add_argument("--anchor-chunk", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-rows", type=int)
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0, help="the anchors' seed (a run evaluates with its own seed)")
    p.add_argument("--round-anchors", action="store_true",
                   help="also follow T=0 rounds along each response (round_* metrics); pass --num-anchors >= --seq-len")

    args = parser.parse_args(argv)
    if args.command == "selfdistill":
        from dspark_jax.engine import EngineConfig
        from training.drafter.selfdistill import self_distill

        cfg = _config(args, SelfDistillConfig)
        ec = EngineConfig(max_running_requests=args.max_running, max_prefill_tokens=4096,
                          max_prefill_seqs=min(32, args.max_running),
                          max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens)
        out = self_distill(args.target, args.corpus, args.out, cfg, engine_config=ec, time_limit_s=args.time_limit_s,
                           progress=not args.no_progress)
    elif args.command == "train":
        from training.drafter.loop import train_drafter

        summary = train_drafter(args.target, args.data, args.out, _config(args, DrafterTrainConfig),
                                stop_at=args.stop_at, progress=not args.no_progress)
        out = {k: summary[k] for k in ("steps", "elapsed_s", "epochs", "best", "last_eval")}
    elif args.command == "export":
        from training.drafter.export import export_run

        folder = export_run(args.run, args.out, step=args.step, best=args.best, dtype=args.dtype)
        out = {"wrote": str(folder), "files": sorted(p.name for p in folder.iterdir())}
    else:
        from training.drafter.evaluate import evaluate_drafter

        out = evaluate_drafter(args.target, args.drafter, args.data, split=args.split, seq_len=args.seq_len,
                               num_anchors=args.num_anchors, anchor_chunk=args.anchor_chunk,
                               batch_size=args.batch_size, max_rows=args.max_rows,
                               compute_dtype=args.compute_dtype, seed=args.seed, round_anchors=args.round_anchors)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
