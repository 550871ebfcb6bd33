"""How well the scheduler predicted round times, against how well any per-round prediction could.

The compact + table arm of bench_speculative.py records, for every round, the step time the
scheduler predicted when it chose the budget and the time the engine then measured
(``step_rounds`` in its JSON).  With the embedded pair a round is bound by host work, and two
rounds of the same batch size and regime (overlapped or synchronous) differ by tens of percent:
garbage collection, a detokenization burst, the OS.  No cost model sees that jitter, so a
per-round error has a floor.  This module reports both sides:

* ``total_ratio``: sum of predicted over sum of measured round times, i.e. how far the prediction
  of the time a run takes is off (what a throughput decision depends on);
* ``group medians``: median predicted and measured time per (batch-size bucket, regime);
* ``median_rel_error``: the median per-round |predicted - measured| / measured;
* ``jitter_floor``: the same error for an oracle that predicts each round by the median measured
  time of its own group, knowing every measurement in advance.  A model cannot beat it by much
  without predicting the jitter itself.

    python -m benchmarks.step_prediction benchmarks/results/speculative_default_gpu_bs64_paired_446209e.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def batch_bucket(batch_size) -> np.ndarray:
    """The power of two nearest (in log scale) to each batch size."""
    bs = np.maximum(np.asarray(batch_size, np.float64), 1.0)
    return (2 ** np.round(np.log2(bs))).astype(np.int64)


def prediction_summary(predicted, measured, batch_size, overlapped) -> dict:
    """Per-round prediction quality of one arm's rounds (seconds in, milliseconds in the groups)."""
    pred, meas = np.asarray(predicted, np.float64), np.asarray(measured, np.float64)
    bucket, regime = batch_bucket(batch_size), np.asarray(overlapped, bool)
    if not (pred.shape == meas.shape == bucket.shape == regime.shape) or pred.ndim != 1 or not pred.size:
        raise ValueError("predicted, measured, batch_size and overlapped must be equal-length, non-empty 1-D")
    if not np.all(meas > 0):
        raise ValueError("measured round times must be > 0")
    oracle = np.empty_like(meas)
    groups = []
    for b, r in sorted({(int(b), bool(r)) for b, r in zip(bucket, regime)}):
        idx = (bucket == b) & (regime == r)
        oracle[idx] = np.median(meas[idx])
        groups.append({"batch_bucket": b, "overlapped": r, "rounds": int(idx.sum()),
                       "median_predicted_ms": float(np.median(pred[idx]) * 1e3),
                       "median_measured_ms": float(np.median(meas[idx]) * 1e3)})
    return {"rounds": int(pred.size),
            "total_ratio": float(pred.sum() / meas.sum()),
            "median_rel_error": float(np.median(np.abs(pred - meas) / meas)),
            "jitter_floor": float(np.median(np.abs(oracle - meas) / meas)),
            "groups": groups}


def summarize_results(results: dict, arm: str = "compact+table") -> list[dict]:
    """One summary per (workload, batch) cell of a bench_speculative.py JSON that kept its rounds."""
    out = []
    for row in results["rows"]:
        rounds = row.get("step_rounds")
        if row.get("arm") != arm or not rounds:
            continue
        s = prediction_summary(rounds["predicted_s"], rounds["measured_s"], rounds["batch_size"],
                               rounds["overlapped"])
        out.append({"workload": row["workload"], "batch": row["batch"], **s})
    return out


def markdown(summaries: list[dict]) -> list[str]:
    lines = ["| workload | batch | rounds | sum predicted / sum measured | median per-round error | "
             "jitter floor (oracle group median) | per group: predicted / measured median ms |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for s in summaries:
        groups = "; ".join(f"bs~{g['batch_bucket']} {'overlapped' if g['overlapped'] else 'synchronous'} "
                           f"({g['rounds']}): {g['median_predicted_ms']:.3f} / {g['median_measured_ms']:.3f}"
                           for g in s["groups"])
        lines.append(f"| {s['workload']} | {s['batch']} | {s['rounds']} | {s['total_ratio']:.3f} | "
                     f"{s['median_rel_error']:.1%} | {s['jitter_floor']:.1%} | {groups} |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="a bench_speculative.py JSON")
    ap.add_argument("--arm", default="compact+table")
    ap.add_argument("--out", type=Path, help="write the summaries here (JSON; markdown beside it)")
    args = ap.parse_args(argv)
    summaries = summarize_results(json.loads(args.results.read_text()), args.arm)
    lines = markdown(summaries)
    print("\n".join(lines))
    if args.out:
        args.out.write_text(json.dumps({"source": str(args.results), "arm": args.arm, "cells": summaries}, indent=1))
        args.out.with_suffix(".md").write_text(
            f"# Step-time prediction of `{args.arm}` in {args.results.name}\n\n" + "\n\n".join(__doc__.split("\n\n")[1:3])
            + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
