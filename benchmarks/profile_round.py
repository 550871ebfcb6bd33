"""Where a DSpark round's time goes beside the plain engine's decode step: per-kernel device times.

At each batch size, three calls over the same target weights, each dispatched --steps times back
to back under the JAX profiler and read back from its trace (profile_decode_step.summarize):

* plain: the plain engine's greedy decode step;
* decode round: the DSpark engine's plain decode round (the target's next token, the row also
  extending the drafter's context), which the scheduler runs where no speculative window pays;
* full round: a DSpark round verifying every drafted token.

A decode round that costs much more than the plain step puts a floor under what the scheduler
can save by not speculating: the kernels it adds, and the gaps between them, say where that
floor comes from.  Synthetic steady batches (every request at --context, nothing committed).

    python benchmarks/profile_round.py --pair qwen3-8b --batch-sizes 1 64 128 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_speculative import load_pair
from benchmarks.common import environment, write_results
from benchmarks.profile_decode_step import plain_decode_call, profile_calls
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.spec.config import SpeculativeConfig
from dspark_jax.spec.dspark.synthetic import synthetic_round


def profile_batch(plain: Engine, dspark: Engine, bs: int, context: int, steps: int, top: int) -> list[dict]:
    """One summary per kind at batch size bs."""
    worker = dspark.worker
    out = [{"bs": bs, "kind": "plain", **profile_calls(plain_decode_call(plain, bs, context), steps, top)}]
    for kind, budget in (("decode round", None), ("full round", bs * worker.gamma)):
        with synthetic_round(worker, bs, budget, context) as (tier, call):
            out.append({"bs": bs, "kind": kind, "tier": tier, **profile_calls(call, steps, top, sequence=1000)})
    return out


def report(cells: list[dict], env: dict, args) -> str:
    md = [f"# DSpark rounds beside the plain decode step: {args.pair} pair, context {args.context}\n",
          f"{env['device']}, jax {env['jax']}, {env['date']}, commit {env['commit']}; {args.steps} calls per kind "
          "dispatched back to back under the profiler; span = first kernel start to last kernel end per call, "
          "busy = time some kernel ran, gaps = idle time between kernels.\n",
          "| batch | kind | span us | busy us | gaps us | kernels | span / plain |", "|---:|---|---:|---:|---:|---:|---:|"]
    plain = {c["bs"]: c for c in cells if c["kind"] == "plain"}
    for c in cells:
        if "error" in c:
            md.append(f"| {c['bs']} | {c['kind']} | {c['error']} | | | | |")
            continue
        ratio = c["span_us_per_step"] / plain[c["bs"]]["span_us_per_step"] if "error" not in plain[c["bs"]] else float("nan")
        md.append(f"| {c['bs']} | {c['kind']} | {c['span_us_per_step']:.0f} | {c['busy_us_per_step']:.0f} | "
                  f"{c['gap_us_per_step']:.0f} | {c['kernels_per_step']:.0f} | {ratio:.2f} |")
    for c in cells:
        if "error" in c:
            continue
        seq = c.get("sequence") or []
        if seq:  # where the device sat idle in the last call: the kernels launched after the longest gaps
            idle = sorted(range(len(seq)), key=lambda i: -seq[i]["gap_before_us"])[:6]
            md += ["", f"Batch {c['bs']}, {c['kind']}: longest idle gaps in the last call (kernel index of "
                   f"{len(seq)}, the kernel after the gap, the one before it):", ""]
            md += [f"- {seq[i]['gap_before_us']:.0f} us before #{i} `{seq[i]['name'][:60]}` "
                   f"(after `{seq[i - 1]['name'][:60] if i else '-'}`)" for i in sorted(idle)]
        md += ["", f"## batch {c['bs']}, {c['kind']}", "", "| kernel | calls | us | us/call |", "|---|---:|---:|---:|"]
        md += [f"| `{k['name'][:90]}` | {k['calls_per_step']:.0f} | {k['us_per_step']:.1f} | {k['us_per_call']:.2f} |"
               for k in c["top_kernels"]]
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="default", help="default, or a preset to expand to (qwen3-8b, ...)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)

    env = environment()
    pair = load_pair(args.pair, args.dtype)
    ec = EngineConfig(max_running_requests=max(args.batch_sizes), max_model_len=args.context + 128, precompile=False)
    plain = Engine(pair.target, pair.tokenizer, ec)
    dspark = Engine(pair.target, pair.tokenizer, ec, drafter=pair.drafter,
                    spec=SpeculativeConfig(mode="compact", sts=pair.sts))
    cells = [c for bs in args.batch_sizes for c in profile_batch(plain, dspark, bs, args.context, args.steps, args.top)]
    md = report(cells, env, args)
    write_results(f"round_profile_{args.pair}_{env['platform']}{args.tag}",
                  {"env": env, "pair": args.pair, "context": args.context, "steps": args.steps, "cells": cells}, md,
                  args.out_dir)
    print(md)


if __name__ == "__main__":
    main()
