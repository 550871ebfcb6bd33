"""Command line: `python -m training.mtp --target MODEL_DIR --corpus DIR --out RUN_DIR [options]`.

Trains the MTP / EAGLE-1 chain drafter of a target model folder on the corpus (pretraining's
mixture sampler and validation rows, tokenised with the target's tokenizer.json).  Every
TrainConfig field is an option as in `python -m training.pretrain` (--steps, --batch-size,
--learning-rate, --mixture math=1,code=1,verse=1, ...); --ce-weight / --hidden-weight set the
loss.  Re-running the same command on an existing run directory resumes it.  The drafter lands
in RUN_DIR/mtp (config.json + model.safetensors), loadable with dspark_jax.spec.mtp.model.load_mtp.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from training.corpus import load_manifest
from training.mtp.loop import train_mtp
from training.mtp.step import LossConfig
from training.pretrain.__main__ import _add_config_options
from training.pretrain.config import TrainConfig
from training.pretrain.loop import _sha256, prepare_data


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, type=Path,
                        help="target model folder (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--corpus", required=True, type=Path, help="corpus directory (training.corpus.build)")
    parser.add_argument("--out", required=True, type=Path, help="run directory (created, or resumed)")
    parser.add_argument("--ce-weight", type=float, default=LossConfig.ce_weight)
    parser.add_argument("--hidden-weight", type=float, default=LossConfig.hidden_weight)
    parser.add_argument("--export-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="storage dtype of RUN_DIR/mtp")
    parser.add_argument("--stop-at", type=int, help="end this invocation after this step (checkpointed)")
    parser.add_argument("--no-progress", action="store_true")
    _add_config_options(parser)
    args = parser.parse_args(argv)
    tc = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    tokenizer = args.target / "tokenizer.json"
    if not tokenizer.exists():
        parser.error(f"{args.target}: tokenizer.json is missing")
    sampler, val, _ = prepare_data(args.corpus, tokenizer, tc)
    manifest = load_manifest(args.corpus)
    data_id = {"corpus_seed": manifest["seed"], "tokenizer_sha256": _sha256(tokenizer),
               "corpus_sha256": {w: e["splits"]["train"]["sha256"] for w, e in manifest["workloads"].items()}}
    summary = train_mtp(args.target, args.out, tc, sampler, val, LossConfig(args.ce_weight, args.hidden_weight),
                        data_id=data_id, stop_at=args.stop_at, progress=not args.no_progress,
                        export_dtype=args.export_dtype)
    print(json.dumps({k: summary[k] for k in ("steps", "elapsed_s", "last_eval", "export")}, indent=1))
    return summary


if __name__ == "__main__":
    main()
