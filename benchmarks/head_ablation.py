"""The sequential-head ablation's table: drafters trained by one recipe that differ only in their
head (none = DFlash block drafting, vanilla / gated / RNN Markov heads), each one's held-out
teacher-forced acceptance length per workload, and its gain over the head-less drafter.

Reads what training/head_ablation.sh leaves in RUNS/<head>/: summary.json (the run: steps,
seconds, whether the time limit stopped it) and eval.json (``python -m training.drafter
evaluate``: per-workload metrics).  tau_greedy is the T=0 acceptance length (exact on greedy
held-out responses), tau_probabilistic the T=1 one (1 + the sum of the products of the per-slot
acceptance probabilities).

    python -m benchmarks.head_ablation --runs runs/ablation --heads none vanilla gated rnn --out-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, write_results  # noqa: E402

METRICS = ("tau_greedy", "tau_probabilistic")


def rows(runs: Path, heads: list[str]) -> list[dict]:
    """One row per head: its run's steps and seconds, and the per-workload metrics."""
    out = []
    for head in heads:
        summary = json.loads((runs / head / "summary.json").read_text())
        evaluation = json.loads((runs / head / "eval.json").read_text())
        out.append({"head": head, "steps": summary["steps"], "planned_steps": summary["planned_steps"],
                    "seconds": summary["elapsed_s"], "parameters": summary["parameters"],
                    "workloads": {w: {k: m[k] for k in METRICS} for w, m in sorted(evaluation.items())}})
    return out


def gains(table: list[dict], baseline: str = "none") -> list[dict]:
    """Each row with, per workload and metric, its ratio to the baseline head's (where present)."""
    base = next((r for r in table if r["head"] == baseline), None)
    out = []
    for r in table:
        r = dict(r)
        if base is not None:
            r["over_" + baseline] = {w: {k: m[k] / base["workloads"][w][k] for k in METRICS}
                                     for w, m in r["workloads"].items() if w in base["workloads"]}
        out.append(r)
    return out


def markdown(table: list[dict], env: dict) -> str:
    workloads = sorted({w for r in table for w in r["workloads"]})
    lines = [f"# Sequential-head ablation ({env['device']}, jax {env['jax']}, {env['date']}, commit {env['commit']})", "",
             "Drafters of the embedded target trained by one recipe, differing only in the sequential head "
             "(none: DFlash block drafting); held-out teacher-forced acceptance length per workload, T=0 "
             "(tau_greedy) / T=1 (tau_probabilistic), and in brackets the ratio to the head-less drafter.", "",
             "| head | steps | seconds | " + " | ".join(workloads) + " |",
             "|---|---:|---:|" + "---:|" * len(workloads)]
    for r in table:
        cells = []
        for w in workloads:
            m, g = r["workloads"].get(w), r.get("over_none", {}).get(w)
            if m is None:
                cells.append("-")
                continue
            ratio = f" ({g['tau_greedy']:.2f}x / {g['tau_probabilistic']:.2f}x)" if g and r["head"] != "none" else ""
            cells.append(f"{m['tau_greedy']:.2f} / {m['tau_probabilistic']:.2f}{ratio}")
        steps = f"{r['steps']}" + ("" if r["steps"] == r["planned_steps"] else f" of {r['planned_steps']}")
        lines.append(f"| {r['head']} | {steps} | {r['seconds']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, required=True, help="folder of one run folder per head")
    ap.add_argument("--heads", nargs="+", required=True)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)
    env = environment()
    table = gains(rows(args.runs, args.heads))
    md = markdown(table, env)
    write_results(f"head_ablation_{env['platform']}{args.tag}", {"env": env, "rows": table}, md, args.out_dir)
    print(md)


if __name__ == "__main__":
    main()
