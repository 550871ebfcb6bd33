"""Replay the cost table's online level correction on rounds a speculative benchmark recorded.

bench_speculative.py keeps, for its compact + table arm, every round's raw table prediction,
measured time, batch size and whether it was dispatched with another round in flight
(``step_rounds`` in its JSON).  This script feeds those rounds, in order, through
``StepTimeCorrection`` under several settings and reports the median per-round error of the
prediction each setting would have made, so a correction can be judged on a real device's rounds
without spending device time:

* ``one level``: one moving average over every round (the engine before 9bade93);
* ``per regime``: one for overlapped rounds and one for synchronous ones (the scheduler now).

It follows the engine's timing: an overlapped round is predicted before the round ahead of it is
read (so without that round's update), a synchronous one after.  The warm-up pass's rounds are
not in the JSON, so every replay starts from an empty average (the engine had learned a little
more by the first timed round).

    python -m benchmarks.replay_step_time_correction benchmarks/results/speculative_default_gpu_bs64_paired_8a94278.json
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np

from dspark_jax.spec.dspark.step_time_correction import StepTimeCorrection


def replay(table_s, measured_s, batch_size, overlapped, bs_probes, weight: float, per_regime: bool) -> np.ndarray:
    """The prediction (table + learned level) for every round, in seconds."""
    regimes = (True, False) if per_regime else (True,)
    state = {r: StepTimeCorrection(bs_probes, weight) for r in regimes}
    before_last = copy.deepcopy(state)  # the averages before the latest round's update
    pred = np.empty(len(table_s))
    for i, (t, m, bs, ov) in enumerate(zip(table_s, measured_s, batch_size, overlapped)):
        regime = bool(ov) if per_regime else True
        seen = before_last if ov else state  # overlapped: dispatched before round i-1 was read
        pred[i] = t + seen[regime].offset(bs)
        before_last = copy.deepcopy(state)
        state[regime].update(bs, t, m)
    return pred


def median_rel_error(pred, measured) -> float:
    measured = np.asarray(measured)
    return float(np.median(np.abs(pred - measured) / measured))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json", type=Path, help="a bench_speculative.py JSON with a compact+table arm")
    ap.add_argument("--table", type=Path, required=True,
                    help="the cost table the run used (the averages are kept per batch-size probe of it)")
    ap.add_argument("--weights", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    ap.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = ap.parse_args(argv)
    from dspark_jax.spec.dspark.cost_model import load_cost_table

    probes = load_cost_table(args.table).bs_probes
    rows = []
    for r in json.loads(args.bench_json.read_text())["rows"]:
        rounds = r.get("step_rounds")
        if not rounds:
            continue
        t, m = np.asarray(rounds["table_s"]), np.asarray(rounds["measured_s"])
        bs, ov = np.asarray(rounds["batch_size"]), np.asarray(rounds["overlapped"], bool)
        row = {"arm": r["arm"], "workload": r["workload"], "batch": r["batch"], "rounds": len(m),
               "overlapped_fraction": float(ov.mean()), "raw_table": median_rel_error(t, m),
               "in_run": r.get("step_median_rel_error")}
        for w in args.weights:
            for per_regime in (False, True):
                key = f"{'per_regime' if per_regime else 'one_level'}_w{w:g}"
                row[key] = median_rel_error(replay(t, m, bs, ov, probes, w, per_regime), m)
        rows.append(row)
    keys = [k for k in rows[0] if k.startswith(("one_level", "per_regime"))] if rows else []
    md = [f"# Level-correction replay on `{args.bench_json.name}`\n",
          "Median per-round |predicted - measured| / measured, rounds replayed in order "
          "(benchmarks/replay_step_time_correction.py).\n",
          "| workload | batch | rounds | overlapped | raw table | in the run | " + " | ".join(keys) + " |",
          "|---|---:|---:|---:|---:|---:|" + "---:|" * len(keys)]
    for row in rows:
        in_run = f"{row['in_run']:.3f}" if row["in_run"] is not None else ""
        md.append(f"| {row['workload']} | {row['batch']} | {row['rounds']} | {row['overlapped_fraction']:.2f} | "
                  f"{row['raw_table']:.3f} | {in_run} | " + " | ".join(f"{row[k]:.3f}" for k in keys) + " |")
    text = "\n".join(md) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"source": str(args.bench_json), "rows": rows}, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
