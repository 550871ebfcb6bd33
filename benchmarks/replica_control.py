"""Is an arm faster than the reference arm, or only as different as the reference is from itself?

bench_speculative.py pairs every arm with the static arm pass by pass (the arms of one pass run
back to back, so a slow stretch of the host cancels in the ratio).  At batch 64 with the embedded
pair those per-pass ratios still spread by +-5-10%, and a median a few percent below 1 can be the
measurement's own bias (which arm is the reference, engine instances, garbage collection) rather
than the arm's.  The control is a replica: a second engine built exactly as the reference
(``static@2`` beside ``static`` with ``--rounds-per-call 2``), paired with the reference the same
way.  An arm whose pooled ratio lies inside the replica's interval cannot be told from the
reference.

For each arm: the median over every pass of every cell (and of every JSON given) of
reference wall / arm wall, with a percentile-bootstrap 95% interval over passes, beside the
replica's; and the per-cell medians.

    python -m benchmarks.replica_control run1.json run2.json --replica static@2 --arm compact+table
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def paired_log_ratios(rows: list[dict], arm: str, reference: str = "static") -> dict[tuple, np.ndarray]:
    """log(reference wall / arm wall) per timed pass, by (workload, batch) cell."""
    walls = {(r["workload"], r["batch"], r["arm"]): np.asarray(r["wall_s_passes"], np.float64) for r in rows}
    out = {}
    for (w, b, a), arm_walls in walls.items():
        ref = walls.get((w, b, reference))
        if a != arm or ref is None:
            continue
        if ref.shape != arm_walls.shape or not (np.all(ref > 0) and np.all(arm_walls > 0)):
            raise ValueError(f"cell {w}/{b}: passes of {arm} and {reference} do not pair")
        out[w, b] = np.log(ref / arm_walls)
    return out


def pooled_ratio(log_ratios: list[np.ndarray], resamples: int = 4000, seed: int = 0) -> dict:
    """Median ratio over all passes, with a percentile-bootstrap 95% interval (passes resampled)."""
    x = np.concatenate(log_ratios)
    if not x.size:
        raise ValueError("no paired passes")
    rng = np.random.default_rng(seed)
    boot = np.median(rng.choice(x, size=(resamples, x.size)), axis=1)
    lo, hi = np.exp(np.percentile(boot, [2.5, 97.5]))
    return {"passes": int(x.size), "median": float(np.exp(np.median(x))), "ci95": [float(lo), float(hi)]}


def compare(results: list[dict], arms: list[str], replica: str, reference: str = "static") -> dict:
    """Pooled and per-cell paired ratios of each arm and of the replica against the reference."""
    out = {"reference": reference, "replica": replica, "arms": {}}
    for arm in [replica, *arms]:
        cells, logs = [], []
        for i, res in enumerate(results):
            for (w, b), lr in sorted(paired_log_ratios(res["rows"], arm, reference).items()):
                cells.append({"run": i, "workload": w, "batch": b, "passes": int(lr.size),
                              "median": float(np.exp(np.median(lr)))})
                logs.append(lr)
        if not logs:
            raise ValueError(f"no cell pairs {arm} with {reference}")
        out["arms"][arm] = {**pooled_ratio(logs), "cells": cells}
    rep = out["arms"][replica]
    for arm in arms:
        a = out["arms"][arm]
        a["inside_replica_interval"] = bool(rep["ci95"][0] <= a["median"] <= rep["ci95"][1])
    return out


def markdown(summary: dict, sources: list[str]) -> str:
    ref, rep = summary["reference"], summary["replica"]
    lines = [f"Paired per pass: {ref} wall / arm wall; median over all passes of all cells, percentile-bootstrap "
             f"95% interval over passes. `{rep}` is a second engine built as `{ref}` (the control). "
             f"Sources: {', '.join(sources)}.", "",
             "| arm | passes | median | 95% interval | per-cell medians | inside the replica's interval |",
             "|---|---:|---:|---|---|---|"]
    for arm, a in summary["arms"].items():
        cells = ", ".join(f"{c['workload']} {c['median']:.2f}" for c in a["cells"])
        inside = "" if arm == rep else ("yes" if a["inside_replica_interval"] else "no")
        lines.append(f"| {arm} | {a['passes']} | {a['median']:.3f} | [{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}] "
                     f"| {cells} | {inside} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="bench_speculative.py JSONs")
    ap.add_argument("--reference", default="static")
    ap.add_argument("--replica", default="static@2")
    ap.add_argument("--arm", action="append", default=None, help="arms to test (default: compact+table)")
    ap.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    args = ap.parse_args(argv)
    results = [json.loads(p.read_text()) for p in args.results]
    summary = compare(results, args.arm or ["compact+table"], args.replica, args.reference)
    summary["sources"] = [p.name for p in args.results]
    text = markdown(summary, summary["sources"])
    print(text)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
        args.out.with_suffix(".md").write_text("# Arm vs replica control\n\n" + text)


if __name__ == "__main__":
    main()
