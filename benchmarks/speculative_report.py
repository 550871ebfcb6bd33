"""The tier sweep's report: the markdown table and JSON of every cell, and the frontier plot
(output tok/s against per-user tok/s, one curve per arm) per workload."""

from __future__ import annotations

import numpy as np

from benchmarks.common import write_results
from benchmarks.speculative_arms import ARMS, parse_arm
from benchmarks.step_prediction import markdown as prediction_markdown


def report(args, env, rows: list[dict]) -> None:
    """Ratios against the plain engine of the same run, token equality, JSON + markdown."""
    base = {(r["workload"], r["batch"]): r for r in rows if r["arm"] == "none"}
    static = {(r["workload"], r["batch"]): r for r in rows if r["arm"] == "static"}
    out = []
    for r in rows:
        r = dict(r)
        s = static.get((r["workload"], r["batch"]))
        if s is not None and r["arm"] != "static":
            # Paired by pass: the arms of one pass ran back to back, so a slow stretch of the host
            # that spans a pass cancels in its ratio (the medians of separate passes do not pair).
            r["paired_speedup_vs_static"] = [sw / aw for sw, aw in zip(s["wall_s_passes"], r["wall_s_passes"])]
        b = base.get((r["workload"], r["batch"]))
        if b is not None:
            r["speedup_vs_none"] = r["tok_s"] / b["tok_s"]
        if b is not None and args.temperature == 0:  # sampled outputs follow the same law, not the same draws
            r["same_tokens_as_none"] = r["outputs"] == b["outputs"]
            # Where outputs part: requests that differ, and the first differing token of each.
            firsts = [next((i for i, (x, y) in enumerate(zip(o, g)) if x != y), min(len(o), len(g)))
                      for o, g in zip(r["outputs"], b["outputs"]) if o != g]
            r["diverged_requests"] = len(firsts)
            r["first_divergence_tokens"] = firsts
        r.pop("outputs")
        out.append(r)
    rows = out
    payload = {"env": env, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    md = [f"# Speculative decoding, pair {args.pair} ({env['device']}, jax {env['jax']}, {env['date']}, "
          f"commit {env['commit']})\n",
          f"Temperature {args.temperature:g}" + (f" (top-k {args.top_k}, top-p {args.top_p:g}; no token "
                                                   "comparison: sampled outputs follow the target's law, not "
                                                   "the plain engine's draws)" if args.temperature > 0 else "") +
          f", {args.max_new_tokens} new tokens per request, prompts from {args.corpus or args.prompts}; batch 1 = "
          f"{args.single_prompts} prompts one after another; batch b > 1 = {args.waves} x b prompts, at most b "
          "running at once (requests: how many the workload had). tok/s = generated tokens / wall time (prefill "
          f"included), median of {args.repeats} passes with the arms interleaved; x none = ratio to the plain "
          "engine in this run; per user = a request's decode tokens / its decode time, averaged; accept = tokens "
          "committed per round (bonus included); util = accept / uncensored block-accept length; window = verified tokens per request per round (anchor included); step pred/meas = "
          "median predicted vs measured round time (compact with the cost table); same tokens = every request's output equals "
          "the plain engine's, else how many requests differ and the median token where they first do; "
          "x static paired = median over passes of the arm's tok/s over static's in the same pass "
          "[lowest, highest]; round ms = median round period at the cell's full batch, overlapped (steady "
          "loop) / synchronous (first round after an admission drained the loop), over the timed passes.\n",
          f"Engines in {args.dtype or 'the checkpoint dtype'}, matmul precision {args.matmul_precision or 'default'}, "
          f"execution {args.execution}, {args.rounds_per_call} DSpark round(s) per dispatch.\n",
          "| workload | batch | requests | arm | tok/s | x none | per user | x static paired | accept | window | util | "
          "round ms overl / sync | step pred / meas ms | same tokens |",
          "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["workload"], r["batch"], ARMS.index(parse_arm(r["arm"]).base), r["arm"])):
        step = (f"{r['step_predicted_ms']:.3f} / {r['step_measured_ms']:.3f}"
                if "step_predicted_ms" in r else "")
        same = r.get("same_tokens_as_none", "")
        if same is False:
            same = (f"no: {r['diverged_requests']}/{r['requests']} differ, from token "
                    f"{int(np.median(r['first_divergence_tokens']))}")
        rounds = " / ".join(f"{r[k]:.3f}" if k in r else "-" for k in ("round_ms_full_batch_overlapped",
                                                                     "round_ms_full_batch_synchronous"))
        paired = r.get("paired_speedup_vs_static")
        paired = f"{np.median(paired):.2f} [{min(paired):.2f}, {max(paired):.2f}]" if paired else ""
        md.append(f"| {r['workload']} | {r['batch']} | {r['requests']} | {r['arm']} | {r['tok_s']:.0f} | "
                  f"{r.get('speedup_vs_none', float('nan')):.2f} | {r.get('per_user_tok_s', float('nan')):.1f} | "
                  f"{paired} | {r.get('accept_length', 1.0):.2f} | {r.get('window', float('nan')):.2f} | "
                  f"{r.get('utilization', float('nan')):.2f} | {rounds} | {step} | {same} |")
    predictions = [{"workload": r["workload"], "batch": r["batch"], **r["step_prediction"]}
                   for r in rows if "step_prediction" in r]
    if predictions:
        md += ["", "Step-time prediction of compact + table: sum of predicted over sum of measured round times; "
               "the median per-round error beside its jitter floor (an oracle predicting each round by the median "
               "measured time of its batch-size bucket and regime; benchmarks/step_prediction.py).", "",
               *prediction_markdown(predictions)]
    mixed = [r for r in rows if r.get("by_workload")]
    if mixed:
        md += ["", "Mixed traffic by workload: accept length, mean verify window and utilization of each "
               "workload's requests within the mixed stream (SGLang's blog: windows 5.24 / 3.78 / 2.91 and "
               "utilization 0.88-0.97 for its three workloads).", "",
               "| batch | arm | workload | requests | accept | window | util |", "|---:|---|---|---:|---:|---:|---:|"]
        for r in sorted(mixed, key=lambda r: (r["batch"], ARMS.index(parse_arm(r["arm"]).base), r["arm"])):
            for w, s in r["by_workload"].items():
                md.append(f"| {r['batch']} | {r['arm']} | {w} | {s['requests']} | {s['accept_length']:.2f} | "
                          f"{s['window']:.2f} | {s['utilization']:.2f} |")
    name = f"speculative_{args.pair}_{env['platform']}{args.tag}"
    for p in write_results(name, payload, "\n".join(md) + "\n", args.out_dir):
        print("wrote", p)
    plot_frontier(rows, name, args.out_dir)
    print("\n".join(md))


def plot_frontier(rows: list[dict], name: str, out_dirs) -> None:
    """Output tok/s against per-user tok/s, one curve per arm over the batch sizes, per workload."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from benchmarks.common import result_dirs

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.8), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for arm in sorted({r["arm"] for r in rows}, key=lambda a: ARMS.index(parse_arm(a).base)):
            pts = sorted((r["per_user_tok_s"], r["tok_s"]) for r in rows
                         if r["workload"] == w and r["arm"] == arm and "per_user_tok_s" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=arm)
        ax.set_title(w)
        ax.set_xlabel("per-user tok/s")
        ax.set_ylabel("output tok/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    for d in result_dirs(out_dirs):
        d.mkdir(parents=True, exist_ok=True)
        fig.savefig(d / f"{name}_frontier.png", dpi=110)
    plt.close(fig)
