"""Where a generate pass spends its time: host CPU per pass and one profiler trace, summarised.

Runs ``dspark_jax.generate`` (this tree's, or another tree's with --tree, e.g. the tree before a
change as paired_trees.py takes it) in this process on prompts of a workload, and wraps the
engine's ``generate``: two warm passes, --passes timed ones (wall seconds and main-thread CPU
seconds: the loop's own host work, since XLA computes on threads of its own), then one pass under
``jax.profiler`` whose Perfetto trace is summarised per event name for the Python thread (host:
dispatch, transfers, reads) and each GPU stream (kernels).  Two trees' summaries side by side say
whether a slower pass is host or device time, and which events moved.

    python benchmarks/trace_pass.py --name after --out-dir $OUT -- \\
        --speculative-algorithm DSPARK --verify-mode static --max-running-requests 64 --max-new-tokens 96
    python benchmarks/trace_pass.py --tree /tmp/old --name before --out-dir $OUT -- ...

Writes NAME.json (passes and summary), NAME.md (the top events) and NAME.perfetto.json.gz.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def summarize_trace(events: list[dict], top: int = 25) -> dict:
    """Per track (the host's Python thread, each GPU stream): span, event count, summed duration,
    and the events with the largest summed duration (name, count, ms)."""
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[e["pid"], e.get("tid")] = e["args"]["name"]
    by_track: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    span: dict = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        proc, thread = pname.get(e["pid"], str(e["pid"])), tname.get((e["pid"], e.get("tid")), str(e.get("tid")))
        if "GPU" not in proc and thread != "python":
            continue
        track = f"{proc} | {thread}"
        cell = by_track[track][e["name"][:100]]
        cell[0] += 1
        cell[1] += e.get("dur", 0.0)
        lo, hi = span.get(track, (float("inf"), 0.0))
        span[track] = (min(lo, e["ts"]), max(hi, e["ts"] + e.get("dur", 0.0)))
    out = {}
    for track, names in by_track.items():
        ranked = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
        out[track] = {"span_ms": (span[track][1] - span[track][0]) / 1e3,
                      "events": sum(c for c, _ in names.values()),
                      "summed_ms": sum(d for _, d in names.values()) / 1e3,
                      "top": [{"name": n, "count": c, "ms": d / 1e3} for n, (c, d) in ranked]}
    return out


def _wrap_generate(engine_class, passes: int, trace_dir: str, report: dict) -> None:
    """Make engine_class.generate warm up, time `passes` passes and trace one more."""
    import jax

    inner = engine_class.generate

    def generate(self, *a, **k):
        inner(self, *a, **k)
        inner(self, *a, **k)  # warm: every executable this pass needs is compiled
        for _ in range(passes):
            c0, t0 = time.thread_time(), time.perf_counter()
            inner(self, *a, **k)
            report["passes"].append({"wall_s": time.perf_counter() - t0, "host_cpu_s": time.thread_time() - c0})
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            t0 = time.perf_counter()
            out = inner(self, *a, **k)
            report["traced_wall_s"] = time.perf_counter() - t0
        report["tokens"] = sum(len(r.token_ids) for r in out)
        return out

    engine_class.generate = generate


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=str(ROOT), help="source tree whose engine runs (default: this one)")
    ap.add_argument("--tree-commit", default=None, help="the commit --tree holds, for the record")
    ap.add_argument("--name", default="trace_pass")
    ap.add_argument("--workload", default="code", help="benchmarks/prompts/WORKLOAD.jsonl")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--passes", type=int, default=3, help="timed passes before the traced one")
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args(own)
    sys.path.insert(0, str(Path(args.tree).resolve()))
    from dspark_jax import generate as cli
    from dspark_jax.engine import Engine

    report: dict = {"tree": args.tree, "tree_commit": args.tree_commit, "engine_args": engine_args, "passes": []}
    trace_dir = tempfile.mkdtemp(prefix="trace_pass_")
    _wrap_generate(Engine, args.passes, trace_dir, report)  # (speculative engines inherit it)
    lines = (ROOT / "benchmarks" / "prompts" / f"{args.workload}.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines[: args.prompts]]
    with open(os.devnull, "w") as null:
        stdout, sys.stdout = sys.stdout, null
        try:
            cli.main(engine_args + [a for p in prompts for a in ("--prompt", p)] + ["--ignore-eos", "--json"])
        finally:
            sys.stdout = stdout
    trace = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if trace:
        data = json.load(gzip.open(trace[0]))
        report["summary"] = summarize_trace(data["traceEvents"] if isinstance(data, dict) else data)
        shutil.move(trace[0], out / f"{args.name}.perfetto.json.gz")
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import environment

    env = report["environment"] = environment()
    rows = [f"# {args.name}: {args.tree} ({args.tree_commit or env['commit']}), `{' '.join(engine_args)}`\n",
            f"{env['device']}, jax {env['jax']}, {env['date']}; {args.prompts} {args.workload} prompts a pass.\n",
            "| pass | wall s | host CPU s |", "|---:|---:|---:|"]
    rows += [f"| {i} | {p['wall_s']:.3f} | {p['host_cpu_s']:.3f} |" for i, p in enumerate(report["passes"])]
    for track, t in report.get("summary", {}).items():
        rows += [f"\n{track}: span {t['span_ms']:.1f} ms, {t['events']} events, summed {t['summed_ms']:.1f} ms\n",
                 "| event | count | ms |", "|---|---:|---:|"]
        rows += [f"| `{e['name']}` | {e['count']} | {e['ms']:.2f} |" for e in t["top"]]
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str))
    (out / f"{args.name}.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows[:4 + len(report["passes"])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
