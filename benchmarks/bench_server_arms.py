"""Servers against each other under the same load: is the default ever slower than plain decoding?

Starts one `serving.launch` per arm (each on its own loopback port, all up at once, idle while
another is measured), then for each concurrency runs `load_generator` against the arms in turn,
`--repeats` times, interleaved (A B A B ...) so drift in the machine's load hits every arm alike.
Reports output tok/s per arm and concurrency, the median over repeats, and each arm's ratio to the
first arm (the reference, by default plain decoding); beside it, from each server's /metrics
counters over the same runs, what the engine did: mean step time, tokens per step, and for a
speculative server its mean verify window and accept length.

    python benchmarks/bench_server_arms.py --concurrency 1,16,128 --duration 40 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import load_generator  # noqa: E402
from benchmarks.common import environment, write_results  # noqa: E402
from benchmarks.server_process import http, launch, stop, wait_healthy  # noqa: E402

DEFAULT_ARMS = ("none=--speculative-algorithm NONE", "default=")
COUNTERS = ("engine_steps_total", "generation_tokens_total", "step_time_seconds_sum", "spec_verify_calls_total",
            "spec_verify_tokens_total", "spec_accepted_tokens_total")


def counters(base: str) -> dict[str, float]:
    """The server's cumulative counters (those it has of COUNTERS)."""
    text = http(base + "/metrics")[1].decode()
    return {s.name.removeprefix("dspark:"): s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.removeprefix("dspark:") in COUNTERS}


def engine_view(before: dict, after: dict) -> dict:
    """What the engine did between two counter reads: steps, mean step time, tokens per step, and
    the mean verify window and accept length of its verified rows (speculative servers)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    steps, rows = d["engine_steps_total"], d["spec_verify_calls_total"]
    return {"steps": int(steps),
            "step_ms": 1e3 * d["step_time_seconds_sum"] / steps if steps else None,
            "tokens_per_step": d["generation_tokens_total"] / steps if steps else None,
            "verify_rows": int(rows),
            "mean_window": d["spec_verify_tokens_total"] / rows if rows else None,
            "accept_length": d["spec_accepted_tokens_total"] / rows if rows else None, "raw": d}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", help="NAME=FLAGS for serving.launch (repeatable; the first is "
                                                   f"the reference); default: {' and '.join(DEFAULT_ARMS)}")
    ap.add_argument("--concurrency", default="1,16,128")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of load per measurement")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--base-port", type=int, default=31000)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--name", default="server_arms_cpu")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)
    arms = [a.split("=", 1) for a in (args.arm or DEFAULT_ARMS)]
    levels = [int(c) for c in args.concurrency.split(",")]
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_server_arms"
    log_dir.mkdir(parents=True, exist_ok=True)

    procs, running = {}, {}
    try:
        for i, (name, flags) in enumerate(arms):  # one at a time: start-up compiles on every core
            log = log_dir / f"server_{name}.log"
            procs[name] = launch(shlex.split(flags), log, port=args.base_port + i)
            wait_healthy(*procs[name], args.startup_timeout, log)
            # what the server runs (a DSpark default may serve plain steps where its table says so)
            info = json.loads(http(procs[name][1] + "/server_info")[1] or b"{}")
            running[name] = info.get("speculative_algorithm", "?")
        runs = {name: {c: [] for c in levels} for name, _ in arms}
        bar = tqdm(total=len(levels) * args.repeats * len(arms), desc="load", unit="run")
        for c in levels:
            for r in range(args.repeats):
                for name, _ in arms:
                    ns = argparse.Namespace(
                        base_url=procs[name][1], model=None, num_requests=100000, concurrency=c,
                        max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True,
                        prompt="The quick brown fox jumps over the lazy dog while the cat watches from the warm window",
                        shuffle_prompts=True, duration=args.duration, grace=30.0, seed=r)
                    before = counters(procs[name][1])
                    rep = asyncio.run(load_generator.run(ns))
                    rep.pop("config")
                    rep["engine"] = engine_view(before, counters(procs[name][1]))
                    runs[name][c].append(rep)
                    bar.set_postfix_str(f"c={c} {name} {rep['output_throughput_tok_s'] or 0:.0f} tok/s")
                    bar.update()
        bar.close()
    finally:
        for proc, _ in procs.values():
            stop(proc)

    ref = arms[0][0]
    table = {name: {c: float(np.median([x["output_throughput_tok_s"] or 0 for x in runs[name][c]])) for c in levels}
             for name, _ in arms}
    env = environment()
    rows = [f"# Servers under the same load: output tok/s ({env['device']}, {os.cpu_count()} cores)\n",
            f"jax {env['jax']}, python {env['python']}, {env['date']}, commit {env['commit']}; "
            f"{args.duration:.0f} s per run, median of {args.repeats} interleaved runs, max_tokens "
            f"{args.max_tokens}, T={args.temperature}.\n",
            "| arm | flags | runs | " + " | ".join(f"{c} streams (ratio to {ref})" for c in levels) + " |",
            "|---|---|---|" + "---|" * len(levels)]
    for name, flags in arms:
        cells = [f"{table[name][c]:.1f} ({table[name][c] / table[ref][c]:.2f}x)" if table[ref][c] else "-"
                 for c in levels]
        rows.append(f"| {name} | `{flags or '(defaults)'}` | {running[name]} | " + " | ".join(cells) + " |")
    rows += ["\nThe engine over the same runs (summed over repeats): mean step ms / tokens per step / mean verify "
             "window / accept length (- where it verified nothing).\n",
             "| arm | " + " | ".join(f"{c} streams" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for name, _ in arms:
        cells = []
        for c in levels:
            v = engine_view({}, {k: sum(x["engine"]["raw"][k] for x in runs[name][c]) for k in COUNTERS})
            cells.append(" / ".join("-" if v[k] is None else f"{v[k]:.2f}"
                                    for k in ("step_ms", "tokens_per_step", "mean_window", "accept_length")))
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    failed = sum(x["requests_failed"] for a in runs.values() for c in a.values() for x in c)
    rows.append(f"\nFailed requests: {failed}.\n")
    md = "\n".join(rows)
    print(md)
    write_results(args.name, {"environment": env, "arms": dict(arms), "running": running, "concurrency": levels,
                              "duration_s": args.duration, "repeats": args.repeats,
                              "median_output_tok_s": table, "runs": runs}, md, args.out_dir)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
