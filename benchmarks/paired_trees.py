"""Two source trees, the same tier-sweep command, alternated: is a change slower than the noise?

A refactor must not slow any arm.  On a host-bound pair the spread between two runs of one tree
is 20-30%, so one run of each tree proves nothing; this runs bench_speculative.py from the tree
before the change (a directory, e.g. ``git archive OLD | tar -x -C DIR``) and from this tree,
--rounds times each, alternating which goes first, and reports per cell (workload, batch, arm):

- each tree's median tok/s over the rounds and its spread (max / min over the rounds), the noise
  of that tree's own repeats;
- after / before per round (the two runs of a round are neighbours in time) and their median:
  the change is slower than the noise where that median is below 1 by more than the spread.

    python benchmarks/paired_trees.py --before /tmp/old --before-commit e538b7d --rounds 3 \\
        --out-dir $OUT -- --corpus .data/corpus --batch-sizes 1 64 --arms none,static,compact,mtp

Arguments after ``--`` go to both trees' bench_speculative.py; --before-args / --after-args add
to one side (flags one tree lacks).  A before tree without dspark_jax/assets gets this tree's.
Each run's result stays in --out-dir/<name>_runs: with --budget-s a long check can be split over
several invocations, each going on from the runs already there.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def summarize(runs: list[dict]) -> list[dict]:
    """runs: [{"tree": "before" | "after", "round": r, "rows": bench rows}] -> one row per cell
    with both trees' tok/s per round, medians, spreads and the per-round ratios."""
    cells: dict[tuple, dict] = {}
    for run in runs:
        for row in run["rows"]:
            key = (row["workload"], row["batch"], row["arm"])
            cells.setdefault(key, {"before": {}, "after": {}})[run["tree"]][run["round"]] = row["tok_s"]
    out = []
    for (workload, batch, arm), by_tree in sorted(cells.items()):
        cell = {"workload": workload, "batch": batch, "arm": arm}
        for tree in ("before", "after"):
            vals = list(by_tree[tree].values())
            cell[f"{tree}_tok_s"] = by_tree[tree]
            cell[f"{tree}_median"] = float(np.median(vals)) if vals else None
            cell[f"{tree}_spread"] = float(max(vals) / min(vals)) if len(vals) > 1 else None
        paired = [by_tree["after"][r] / by_tree["before"][r] for r in sorted(by_tree["after"]) if r in by_tree["before"]]
        cell["ratio_per_round"] = paired
        cell["ratio_median"] = float(np.median(paired)) if paired else None
        out.append(cell)
    return out


def markdown(cells: list[dict], header: str) -> str:
    fmt = lambda x, f="{:.0f}": "-" if x is None else f.format(x)  # noqa: E731
    lines = [header, "", "| workload | batch | arm | before tok/s | spread | after tok/s | spread | after / before per round "
             "| median |", "|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for c in cells:
        per_round = ", ".join(f"{x:.2f}" for x in c["ratio_per_round"]) or "-"
        lines.append(f"| {c['workload']} | {c['batch']} | {c['arm']} | {fmt(c['before_median'])} | "
                     f"{fmt(c['before_spread'], '{:.2f}')} | {fmt(c['after_median'])} | {fmt(c['after_spread'], '{:.2f}')} "
                     f"| {per_round} | {fmt(c['ratio_median'], '{:.2f}')} |")
    ratios = [c["ratio_median"] for c in cells if c["ratio_median"] is not None]
    if ratios:
        lines += ["", f"after / before over {len(ratios)} cells: median {np.median(ratios):.2f}, "
                  f"range {min(ratios):.2f}-{max(ratios):.2f}."]
    return "\n".join(lines) + "\n"


def run_tree(tree: str, tree_dir: Path, commit: str, bench_args: list[str], tag: str, out: Path, timeout: float | None):
    """One bench_speculative.py run from a tree (run from this directory, so relative paths in the
    arguments name the same files for both trees); returns its rows (empty if it wrote none)."""
    env = dict(os.environ, PYTHONPATH=str(tree_dir), GIT_COMMIT=commit, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(tree_dir / "benchmarks" / "bench_speculative.py"), *bench_args, "--tag", tag,
           "--out-dir", str(out)]
    found = sorted(out.glob(f"speculative_*{tag}.json"))
    if found:  # done by an earlier invocation with the same --out-dir: resume, not repeat
        print(f"{tree}: {found[0].name} already there", flush=True)
        return json.loads(found[0].read_text())["rows"]
    t0 = time.perf_counter()
    with open(out / f"{tag.lstrip('_')}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"{tree}: rc {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
    found = sorted(out.glob(f"speculative_*{tag}.json"))
    return json.loads(found[0].read_text())["rows"] if found else []


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the tree before the change (a directory)")
    ap.add_argument("--before-commit", default="before", help="its commit, recorded in the results")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before-args", default="", help="extra bench arguments for the before tree only")
    ap.add_argument("--after-args", default="", help="extra bench arguments for this tree only")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per bench run")
    ap.add_argument("--budget-s", type=float, default=None, help="start no bench run once the time left is below "
                    "the longest run so far; run again with the same --out-dir to go on where it stopped")
    ap.add_argument("--name", default="paired_trees")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    before = args.before.resolve()
    if not (before / "benchmarks" / "bench_speculative.py").exists():
        ap.error(f"{before} holds no benchmarks/bench_speculative.py")
    assets = before / "dspark_jax" / "assets"
    if not assets.exists():
        assets.symlink_to(ROOT / "dspark_jax" / "assets")
    from benchmarks.common import environment, write_results

    env = environment()
    args.out_dir = args.out_dir.resolve()
    raw = args.out_dir / f"{args.name}_runs"
    raw.mkdir(parents=True, exist_ok=True)
    sides = {"before": (before, args.before_commit, shlex.split(args.before_args)),
             "after": (ROOT, env["commit"], shlex.split(args.after_args))}
    runs, start, longest = [], time.perf_counter(), 0.0
    for r in range(1, args.rounds + 1):
        for tree in (("before", "after") if r % 2 else ("after", "before")):
            if args.budget_s is not None and args.budget_s - (time.perf_counter() - start) < longest:
                print(f"{tree} round {r}: not started, the budget is spent", flush=True)
                continue
            tree_dir, commit, extra = sides[tree]
            t0 = time.perf_counter()
            rows = run_tree(tree, tree_dir, commit, bench_args + extra, f"_{tree}_r{r}", raw, args.timeout)
            longest = max(longest, time.perf_counter() - t0)
            runs.append({"tree": tree, "round": r, "rows": rows})
    cells = summarize(runs)
    header = (f"# {args.before_commit} against {env['commit']}: the same tier sweep, alternated ({env['device']}, "
              f"jax {env['jax']}, {env['date']})\n\n`bench_speculative.py {' '.join(bench_args)}`"
              f"{f' (before also {args.before_args})' if args.before_args else ''}"
              f"{f' (after also {args.after_args})' if args.after_args else ''}, "
              f"{len({run['round'] for run in runs if run['rows']})} of {args.rounds} rounds, each running "
              "both trees one after the other, the first alternating. tok/s: median over the rounds of each run's "
              "median pass; spread: max / min over the rounds (that tree's own noise); after / before: per round, "
              "then their median.")
    md = markdown(cells, header)
    write_results(args.name, {"env": env, "before": args.before_commit, "bench_args": bench_args, "cells": cells,
                              "runs": runs}, md, [args.out_dir])
    print(md)


if __name__ == "__main__":
    main()
