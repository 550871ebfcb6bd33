"""Acceptance length by real speculative rounds, per workload and temperature (and STS data).

    python -m training.evaluate_speculative --corpus .data/corpus --split heldout \\
        --per-workload 64 --temperatures 0,1 --out tau.json [--algorithm dspark|mtp]
        [--target DIR] [--drafter DIR] [--sts-path sts.json] [--record-sts-dir DIR]

Teacher-forced tau (training.drafter evaluate) scores the drafter on the target's own
continuations; this runs the engine itself: the drafter drafts from its paged context cache, the
target verifies the full block (static mode), and tau is the mean accepted length per round
including the bonus token, i.e. tokens committed per target forward.  Prompts are cut from a
corpus split exactly as self-distillation cuts them (training.drafter.selfdistill.select_prompts),
so --split heldout evaluates on documents neither the target nor the drafter trained on.

With the DSpark arm the report also carries the confidence head's per-position ECE / AUROC / Brier
of the calibrated survival against the realised prefix acceptance (uncensored: full-block
verification), and --record-sts-dir writes (raw confidence logits, accepted drafts) shards for
python -m training.calibrate_sts (identity temperatures only, i.e. without --sts-path).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _engine(args):
    from dspark_jax.default_model import default_drafter_path, default_model_path, default_mtp_path
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.spec.config import SpeculativeConfig

    target = args.target or default_model_path()
    ec = EngineConfig(max_running_requests=args.max_running, max_model_len=args.max_prompt_tokens + args.max_new_tokens,
                      precompile=not args.lazy_compile)
    if args.algorithm == "mtp":
        return Engine.from_pretrained(target, ec, SpeculativeConfig(algorithm="mtp"),
                                      draft_path=args.drafter or default_mtp_path())
    from dspark_jax.calibration.sts import StsCalibration
    from dspark_jax.spec.dspark.checkpoint import CONFIG_FILE
    from dspark_jax.spec.dspark.config import DSparkConfig

    drafter = args.drafter or default_drafter_path()
    # Explicit, never the folder's own file: this measures calibration.
    sts = (StsCalibration.load(args.sts_path) if args.sts_path else
           StsCalibration.identity(DSparkConfig.from_json(Path(drafter) / CONFIG_FILE).block_size))
    spec = SpeculativeConfig(mode="static", sts=sts, record_sts_dir=args.record_sts_dir)
    return Engine.from_pretrained(target, ec, spec, draft_path=drafter)


def evaluate(engine, prompts: list[dict], temperatures: list[float], max_new_tokens: int, seed: int) -> dict:
    """{temperature: {workload: {tau, rounds, tokens, requests, [confidence]}}} over the prompts."""
    from dspark_jax.sampling import SamplingParams
    from training.drafter.selfdistill import request_seed

    report = {}
    for temp in temperatures:
        per = {}
        for workload in sorted({p["workload"] for p in prompts}):
            group = [p for p in prompts if p["workload"] == workload]
            metrics = getattr(engine.worker, "confidence_metrics", None)
            if metrics is not None:
                metrics.reset()
            set_group = getattr(engine.worker, "set_record_group", None)
            if set_group is not None:  # STS shards then say which workload each row came from
                set_group(workload if len(temperatures) == 1 else f"{workload}@T={temp:g}")
            params = [SamplingParams(temperature=temp, max_new_tokens=max_new_tokens, seed=request_seed(seed, p["id"]))
                      for p in group]
            t0 = time.perf_counter()
            results = engine.generate([p["prompt"] for p in group], params)
            accept = np.concatenate([r.stats["spec"]["accept_lens"] for r in results if "spec" in r.stats])
            per[workload] = {"tau": float(accept.mean()), "rounds": int(accept.size),
                             "tokens": int(sum(len(r.token_ids) for r in results)), "requests": len(results),
                             "seconds": time.perf_counter() - t0}
            if metrics is not None:
                per[workload]["confidence"] = metrics.summary()
            print(f"T={temp:g} {workload}: tau {per[workload]['tau']:.3f} over {per[workload]['rounds']} rounds, "
                  f"{per[workload]['seconds']:.1f} s", file=sys.stderr, flush=True)
        report[f"T={temp:g}"] = per
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, type=Path, help="corpus directory (training.corpus.build)")
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--per-workload", type=int, default=64)
    ap.add_argument("--algorithm", default="dspark", choices=["dspark", "mtp"])
    ap.add_argument("--target", type=Path, help="target folder (default: the embedded default)")
    ap.add_argument("--drafter", type=Path, help="drafter folder (default: the embedded one for --algorithm)")
    ap.add_argument("--sts-path", type=Path, help="STS calibration applied to the confidence head")
    ap.add_argument("--record-sts-dir", help="write STS calibration shards here (DSpark, no --sts-path)")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lazy-compile", action="store_true",
                    help="compile each step shape on first use instead of every tier at start-up (at --max-running "
                         "256 the start-up compile alone outlasted a 150 s budget on a fresh H200 machine)")
    ap.add_argument("--out", type=Path, help="write the report here (JSON)")
    args = ap.parse_args(argv)
    from training.drafter.selfdistill import SelfDistillConfig, select_prompts

    cfg = SelfDistillConfig(split=args.split, per_workload=args.per_workload, max_prompt_tokens=args.max_prompt_tokens)
    prompts = select_prompts(args.corpus, cfg)
    engine = _engine(args)
    prompts = [p for p in prompts if len(engine.encode_prompt(p["prompt"])) <= args.max_prompt_tokens]
    report = {"algorithm": args.algorithm, "split": args.split, "per_workload": args.per_workload,
              "max_new_tokens": args.max_new_tokens, "sts_path": str(args.sts_path) if args.sts_path else None,
              "results": evaluate(engine, prompts, [float(t) for t in args.temperatures.split(",")],
                                  args.max_new_tokens, args.seed)}
    flush = getattr(engine.worker, "flush_records", None)
    if flush is not None:
        flush()
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
