"""Where a speculative round's device time goes, by sampling setting and verify budget.

The cost table prices a round by (batch size, verify budget K).  Whether trimming K can save
time depends on which of the round's kernels scale with the verified tokens: the target's
forward over the packed tier does, the drafter's block and the per-request sampling work do
not.  This profiler builds the compact engine on the embedded pair (or the given pair), sets a
steady batch at --context, and for each (sampling setting, budget fraction) traces --rounds
dispatches of the compiled round with ``jax.profiler``: per round the span of its kernels, the
time they were busy, the gaps between them, and the kernels by total time, beside the wall time
of a blocked call and the period of calls dispatched back to back, and the calling thread's host
events during those dispatches (where the call's own time goes inside jaxlib).

Sampling settings: ``greedy-variant`` (every request at temperature 0, the greedy round
executable: no sort, no draws), ``t0`` (temperature 0 through the general executable, as rounds
run without SpeculativeConfig.greedy_rounds), ``t1`` (temperature 1, no filters), ``t1-topp``
(temperature 1, top-p 0.9: the same executable and work as t1; kept to show it).

    python benchmarks/profile_round.py --batch-size 64 --fractions 0 0.5 1 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
from tqdm import tqdm

from benchmarks.common import device_kernel_events, environment, host_event_summary, time_chain, time_fn, write_results
from benchmarks.profile_decode_step import summarize
from benchmarks.profile_sps import steady_inputs
from dspark_jax.engine import EngineConfig
from dspark_jax.spec.dspark.engine import SpeculativeConfig, SpeculativeEngine

# name -> (temperature, top_k, top_p, greedy round executable)
SETTINGS = {"greedy-variant": (0.0, 0, 1.0, True), "t0": (0.0, 0, 1.0, False), "t1": (1.0, 0, 1.0, False),
            "t1-topp": (1.0, 0, 0.9, False)}

# Kernel families by name fragment, first match wins (XLA names fusions after their root op).
FAMILIES = (("sort", "sort"), ("ragged_paged_attention", "attention"), ("write_kv", "kv write (pallas)"),
            ("triton", "other triton"), ("gemm", "matmul"),
            ("cublas", "matmul"), ("dot", "matmul"), ("rng", "random bits"), ("threefry", "random bits"),
            ("memcpy", "copies"), ("memset", "copies"), ("copy", "copies"), ("reduce", "reductions"),
            ("scatter", "scatter/gather"), ("gather", "scatter/gather"), ("dynamic", "scatter/gather"))


def family(name: str) -> str:
    low = name.lower()
    return next((fam for frag, fam in FAMILIES if frag in low), "other fusions")


def profile_case(eng, bs: int, K: int, setting: str, args) -> dict:
    temperature, top_k, top_p, greedy = SETTINGS[setting]
    T, S, inp = steady_inputs(eng, bs, K, args.context, (temperature, top_k, top_p))
    call = lambda: eng._run_round(T, S, inp, greedy).results
    blocked = time_fn(lambda: jax.block_until_ready(call()), warmup=3, iters=args.rounds)
    chained = time_chain(call, args.rounds)
    trace_dir = tempfile.mkdtemp(prefix="round-trace-")
    with jax.profiler.trace(trace_dir):
        out = None
        for _ in range(args.rounds):
            out = call()
        jax.block_until_ready(out)
    events = device_kernel_events(trace_dir) if jax.default_backend() == "gpu" else []
    # The calling thread's events during the same chained dispatches, where a call's host time
    # goes: those of every round (the chain's one final wait and the trace's stop are not).
    host = [dict(e, count=e["count"] / args.rounds, self_us=e["self_us"] / args.rounds,
                 inclusive_us=e["inclusive_us"] / args.rounds)
            for e in host_event_summary(trace_dir) if e["thread"] == "python" and e["count"] >= args.rounds][:args.top]
    for i in range(bs):
        eng.pool.free(("profile", i))
    fams = collections.defaultdict(float)
    for name, _, d in events:
        fams[family(name)] += d / args.rounds / 1e3
    return {"setting": setting, "bs": bs, "K": K, "tier": T, "blocked_ms": blocked * 1e3, "chained_ms": chained * 1e3,
            "families_us": dict(sorted(fams.items(), key=lambda kv: -kv[1])), "host_events": host,
            **summarize(events, args.rounds, args.top)}


PIPELINES = {  # name -> (feed the previous round's anchors, read each round's results)
    "chain": (False, False), "feed": (True, False), "read": (False, True), "engine": (True, True)}


def pipeline_case(eng, bs: int, K: int, setting: str, rounds: int, context: int) -> dict:
    """The serving loop's pattern without its Python: round t+1 is dispatched while round t is in
    flight (its outputs still held), optionally fed round t's next anchors and positions (device
    arrays not yet computed, as the engine feeds them), then round t's results optionally read
    (one device-to-host copy, started at dispatch).  Per pattern: median host time of the
    dispatch call, of the read, and the period between reads."""
    temperature, top_k, top_p, greedy = SETTINGS[setting]
    # Fed rounds advance every request by up to gamma + 1 positions: keep them inside their pages
    # and the model length (the b346cf1 run did not, and its fed t1 rows outran both).
    step = eng.gamma + 1
    rounds = min(rounds, (eng.max_model_len - context - eng.lookahead) // step - 2)
    if rounds < 4:
        raise ValueError(f"context {context} leaves room for {rounds} fed rounds (need 4): raise --max-model-len")
    T, S, inp = steady_inputs(eng, bs, K, context, (temperature, top_k, top_p), growth=(rounds + 2) * step)
    fed_inp = inp._replace(fed_index=np.where(np.arange(S) < bs, np.arange(S), -1).astype(np.int32))
    out = {}
    for name, (feed, read) in PIPELINES.items():
        prev = eng._run_round(T, S, inp, greedy)
        jax.block_until_ready(prev.results)
        dispatch, reads, periods, last = [], [], [], time.perf_counter()
        for _ in range(rounds):
            step_inp = fed_inp._replace(fed_anchor=prev.next_anchor, fed_start=prev.next_start) if feed else inp
            t0 = time.perf_counter()
            cur = eng._run_round(T, S, step_inp, greedy)
            cur.results.copy_to_host_async()
            t1 = time.perf_counter()
            if read:
                jax.device_get(prev.results)
            else:
                jax.block_until_ready(prev.results)
            t2 = time.perf_counter()
            dispatch.append(t1 - t0)
            reads.append(t2 - t1)
            periods.append(t2 - last)
            last, prev = t2, cur
        jax.block_until_ready(prev.results)
        out[name] = {"dispatch_ms": float(np.median(dispatch)) * 1e3, "wait_or_read_ms": float(np.median(reads)) * 1e3,
                     "period_ms": float(np.median(periods[2:])) * 1e3}
    for i in range(bs):
        eng.pool.free(("profile", i))
    return {"setting": setting, "bs": bs, "K": K, "tier": T, "pipelines": out}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="target (default: the embedded model)")
    ap.add_argument("--draft-model-path", default=None, help="drafter (default: the embedded DSpark drafter)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--max-model-len", type=int, default=544, help="as bench_speculative's engines")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)

    from dspark_jax.default_model import default_drafter_path, default_model_path

    env = environment()
    bs = args.batch_size
    eng = SpeculativeEngine.from_pretrained(
        args.model_path or default_model_path(), args.draft_model_path or default_drafter_path(),
        EngineConfig(max_running_requests=bs, max_model_len=args.max_model_len, precompile=False),
        SpeculativeConfig(mode="compact", greedy_rounds=True))
    G = eng.gamma
    cases = [(s, int(round(f * bs * G))) for s in args.settings for f in args.fractions]
    rows = [profile_case(eng, bs, K, s, args) for s, K in tqdm(cases, desc="cases")]
    pipes = [pipeline_case(eng, bs, K, s, 4 * args.rounds, args.context) for s, K in tqdm(cases, desc="pipelines")]
    name = f"round_profile_{env['platform']}_bs{bs}{args.tag}"
    md = [f"# Speculative round profile, batch {bs} ({env['device']}, jax {env['jax']}, {env['date']}, "
          f"commit {env['commit']})\n",
          f"Compact engine on the embedded pair (gamma {G}), a steady batch at context {args.context}; "
          f"{args.rounds} rounds a case.  blocked: wall time of one dispatched-and-waited round; chained: "
          "period of rounds dispatched back to back; span / busy / gaps: per round from the profiler's "
          "kernel events (busy = time some kernel ran).  Kernel families in us per round.\n",
          "| setting | K | tier | blocked ms | chained ms | span us | busy us | gaps us | kernels | families (us) |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        fams = ", ".join(f"{k} {v:.0f}" for k, v in r["families_us"].items())
        md.append(f"| {r['setting']} | {r['K']} | {r['tier']} | {r['blocked_ms']:.3f} | {r['chained_ms']:.3f} | "
                  f"{r.get('span_us_per_step', float('nan')):.0f} | {r.get('busy_us_per_step', float('nan')):.0f} | "
                  f"{r.get('gap_us_per_step', float('nan')):.0f} | {r.get('kernels_per_step', float('nan')):.0f} | "
                  f"{fams} |")
    md += ["", "The serving loop's pattern without its Python (round t+1 dispatched while round t is in flight): "
           "chain = back to back; feed = fed round t's next anchors and positions on the device; read = round t's "
           "results read to the host after the dispatch; engine = both.  Median ms of the dispatch call / of the "
           "wait or read of round t / of the period.", "",
           "| setting | K | tier | " + " | ".join(PIPELINES) + " |", "|---|---:|---:|" + "---|" * len(PIPELINES)]
    for r in pipes:
        cells = [f"{p['dispatch_ms']:.3f} / {p['wait_or_read_ms']:.3f} / {p['period_ms']:.3f}"
                 for p in r["pipelines"].values()]
        md.append(f"| {r['setting']} | {r['K']} | {r['tier']} | " + " | ".join(cells) + " |")
    for r in rows:
        if r.get("top_kernels"):
            md += ["", f"Top kernels, {r['setting']}, K {r['K']} (tier {r['tier']}):", "",
                   "| kernel | calls/round | us/round |", "|---|---:|---:|"]
            md += [f"| `{k['name'][:90]}` | {k['calls_per_step']:.0f} | {k['us_per_step']:.1f} |"
                   for k in r["top_kernels"]]
    for r in rows:
        if r["host_events"]:
            md += ["", f"Host events on the calling thread, {r['setting']}, K {r['K']} (tier {r['tier']}), per round of "
                   "the chained dispatches, by self time (span minus the events nested in it):", "",
                   "| event | count | self us | inclusive us |", "|---|---:|---:|---:|"]
            md += [f"| `{e['name'][:90]}` | {e['count']:.1f} | {e['self_us']:.1f} | {e['inclusive_us']:.1f} |"
                   for e in r["host_events"]]
    write_results(name, {"env": env, "args": vars(args), "rows": rows, "pipelines": pipes}, "\n".join(md) + "\n", args.out_dir)
    print("\n".join(md))


if __name__ == "__main__":
    main()
