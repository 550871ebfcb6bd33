"""SPS profiler: measure speculative step time over batch size x verify fraction, fit the table.

For each cell (batch size bs, fraction f) the budget is forced to K = round(f * bs * gamma) and the
round's cost recorded; the additive model T(bs, K) = bias + alpha(bs) + theta(bs + K) is then fitted
by least squares (one-hot batch sizes, 64-token M bins) and written as the JSON table the engine
reads (--sps-table-path), with a predicted-vs-measured plot.

Two ways to measure a cell (--method):

* ``engine`` (default): what a server derives at start-up (dspark_jax/spec/dspark/profile.py):
  bs requests (random prompts of --context tokens, EOS ignored) run through the engine's own
  loop -- overlapped rounds, host scheduling and commits included -- with every round forced to
  budget K (or to a plain decode step), and the median of the loop's round periods after
  --warmup rounds is recorded.  That is exactly the quantity the engine later compares its
  predictions with, so the table prices what a round really costs the serving loop.  (SGLang
  profiles the same way, through its real runtime; it also forces one committed token per step,
  which we do not need: the context grows by at most (gamma + 1) * rounds tokens a cell.)
* ``device``: the compiled round executable alone on a steady batch (every request at --context,
  nothing committed between repeats): device time plus dispatch, without the engine's host work.

Both also time a plain decode round per batch size, the table's decode curve.

    python benchmarks/profile_sps.py --model-path TARGET --draft-model-path DRAFTER \\
        --batch-sizes 1 2 4 8 16 32 64 --fractions 0 0.25 0.5 0.75 1 --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from tqdm import tqdm

from benchmarks.common import environment, result_dirs, write_results
from dspark_jax.default_model import default_drafter_path, default_model_path
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.sampling import SamplingParams
from dspark_jax.spec.config import SpeculativeConfig
from dspark_jax.spec.dspark.profile import fit_cells, profile_cells
from dspark_jax.spec.dspark.synthetic import time_round


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="target folder (default: the embedded default model)")
    ap.add_argument("--draft-model-path", default=None, help="DSpark drafter folder (default: the embedded one)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20, help="timed rounds (engine) or repeats (device) per cell")
    ap.add_argument("--warmup", type=int, default=6, help="engine method: rounds dropped per cell")
    ap.add_argument("--method", choices=("engine", "device"), default="engine")
    ap.add_argument("--m-bin", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="sweeps over the whole grid (each cell one sample per sweep)")
    ap.add_argument("--unconstrained", action="store_true",
                    help="plain OLS; default: alpha and theta constrained non-decreasing (cost_model.fit_additive_cost)")
    ap.add_argument("--max-model-len", type=int, default=544, help="as bench_speculative's engines (384 + 128 + 32)")
    ap.add_argument("--temperature", type=float, default=0.0, help="every profiled request's sampling settings: "
                    "a sampling round costs more than a greedy one (its vocabulary sort), so profile the temperature "
                    "you serve")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--lazy-compile", action="store_true", help="compile only the shapes the grid uses")
    ap.add_argument("--rounds-per-call", type=int, default=1, help="SpeculativeConfig.rounds_per_call (as served); "
                    "the engine method then records each round as its call's period over its rounds")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)

    env = environment()
    mx = max(args.batch_sizes)
    # The engine configuration of benchmarks/bench_speculative.py (its default --max-prompt-tokens
    # 384 + --max-new-tokens 128 + 32): the same executables, so a run of both shares the persistent
    # compilation cache, and the table prices the executables the benchmark then runs.
    eng = Engine.from_pretrained(
        args.model_path or default_model_path(),
        EngineConfig(max_running_requests=mx, max_model_len=args.max_model_len, precompile=not args.lazy_compile),
        SpeculativeConfig(mode="compact", rounds_per_call=args.rounds_per_call),
        draft_path=args.draft_model_path or default_drafter_path())
    G = eng.worker.gamma
    print(f"engine compiled in {eng.compile_seconds:.0f} s ({len(eng.worker.tiers.tiers)} token tiers)", flush=True)
    need = args.context + (args.warmup + args.iters + 4) * (G + 1) + eng.lookahead
    if need > eng.max_model_len:
        ap.error(f"a cell needs {need} positions (context + rounds x window + lookahead) > max model len "
                 f"{eng.max_model_len}: lower --context / --iters or raise --max-model-len")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    cells = []
    grid = [(bs, int(round(f * bs * G))) for bs in args.batch_sizes for f in args.fractions]
    grid += [(bs, None) for bs in args.batch_sizes]
    with tqdm(total=args.repeats * len(grid), desc="cells") as bar:
        for rep in range(args.repeats):  # whole sweeps repeated: a drift hits every cell alike
            if args.method == "engine":
                sweep = profile_cells(eng, args.batch_sizes, args.fractions, context=args.context, sampling=sampling,
                                      warmup=args.warmup, iters=args.iters, progress=lambda *_: bar.update())
            else:
                sweep = []
                for bs, K in grid:
                    T, t = time_round(eng.worker, bs, K, args.context, (args.temperature, args.top_k, args.top_p),
                                      iters=args.iters)
                    sweep.append({"bs": bs, "K": K, "M": bs + (K or 0), "tier": T, "seconds": t})
                    bar.update()
            cells += [{"repeat": rep, **c} for c in sweep]
    fit = fit_cells(cells, m_bin=args.m_bin, monotone=not args.unconstrained)
    spec = [c for c in cells if c["K"] is not None]
    for c in cells:
        c["predicted_seconds"] = (fit.table.predict(c["bs"], c["K"]) if c["K"] is not None
                                  else fit.table.predict_decode(c["bs"]))
    rel = np.abs(fit.residual_seconds) / np.array([c["seconds"] for c in spec])
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                "rounds_per_call": args.rounds_per_call}
    payload = {"env": env, "method": args.method, "gamma": G, "context": args.context, "repeats": args.repeats,
               "sampling": sampling,
               "monotone": not args.unconstrained, "cells": cells, "table": fit.table.to_dict(),
               "rms_seconds": fit.rms_seconds, "r_squared": fit.r_squared, "max_relative_error": float(rel.max()),
               "median_relative_error": float(np.median(rel))}
    name = f"sps_table_{env['platform']}{args.tag}"
    out_dirs = result_dirs(args.out_dir)  # a smoke or device run leaves the repository's results alone
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
        fit.table.save(d / f"{name}.table.json")
    md = [f"# SPS cost table ({env['device']}, jax {env['jax']}, {env['date']}, commit {env['commit']})\n",
          f"method {args.method} (engine: round period in the engine's own loop, host work included; "
          f"device: the round executable alone); gamma {G}, context {args.context}, {args.repeats} sweeps; "
          f"temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, "
          f"{args.rounds_per_call} round(s) per dispatch; "
          f"{'OLS' if args.unconstrained else 'alpha, theta non-decreasing'}; fit R^2 {fit.r_squared:.4f}, median |pred-meas|/meas "
          f"{np.median(rel):.1%}, max {rel.max():.1%}.\n",
          "| sweep | bs | K | M | tier | measured ms | predicted ms |", "|---:|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {c['repeat']} | {c['bs']} | {'decode' if c['K'] is None else c['K']} | {c['M']} | {c['tier']} | "
           f"{c['seconds'] * 1e3:.3f} | {c['predicted_seconds'] * 1e3:.3f} |" for c in cells]
    write_results(name, payload, "\n".join(md) + "\n", args.out_dir)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        meas = np.array([c["seconds"] for c in cells]) * 1e3
        pred = np.array([c["predicted_seconds"] for c in cells]) * 1e3
        fig, ax = plt.subplots(figsize=(4.5, 4.5))
        ax.scatter(meas, pred, s=14)
        lim = [0, max(meas.max(), pred.max()) * 1.05]
        ax.plot(lim, lim, "k--", lw=0.8)
        ax.set_xlabel("measured step ms")
        ax.set_ylabel("predicted step ms")
        ax.set_title(f"additive SPS model, {env['device']}")
        fig.tight_layout()
        for d in out_dirs:
            fig.savefig(d / f"{name}.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")
    print("\n".join(md))
    print(json.dumps(fit.table.to_dict()))


if __name__ == "__main__":
    main()
