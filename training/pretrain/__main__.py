"""Command line: `python -m training.pretrain --corpus DIR --tokenizer FILE --out RUN_DIR [options]`.

Every TrainConfig field is an option (--steps, --batch-size, --learning-rate, ...); the mixture
is given as --mixture math=1,code=1,verse=1.  Re-running the same command on an existing run
directory resumes from its latest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

from training.pretrain.config import PRESETS, TrainConfig
from training.pretrain.loop import train


def _parse_mixture(text: str) -> tuple[tuple[str, float], ...]:
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        pairs.append((name.strip(), float(weight) if weight else 1.0))
    return tuple(pairs)


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "mixture":
            parser.add_argument(flag, type=_parse_mixture, default=field.default,
                                help="workload weights, e.g. math=1,code=1,verse=1 (default: equal)")
            continue
        hint = hints[field.name]
        if hint is bool:
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=field.default,
                                metavar="BOOL")
            continue
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        parser.add_argument(flag, type=base, default=field.default, help=f"(default: {field.default})")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, type=Path, help="corpus directory (training.corpus.build)")
    parser.add_argument("--tokenizer", required=True, type=Path, help="tokenizer.json (training.tokenizer)")
    parser.add_argument("--out", required=True, type=Path, help="run directory (created, or resumed)")
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS), help="model shape")
    parser.add_argument("--model-json", help="model shape as JSON Qwen3Config kwargs (overrides --preset)")
    parser.add_argument("--stop-at", type=int, help="end this invocation after this step (checkpointed)")
    parser.add_argument("--no-progress", action="store_true")
    _add_config_options(parser)
    args = parser.parse_args(argv)
    tc = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    model = json.loads(args.model_json) if args.model_json else args.preset
    summary = train(args.corpus, args.tokenizer, args.out, tc, model, stop_at=args.stop_at,
                    progress=not args.no_progress)
    brief = {k: summary[k] for k in ("steps", "tokens", "elapsed_s", "best", "epochs")}
    print(json.dumps(brief, indent=1))
    return summary


if __name__ == "__main__":
    main()
