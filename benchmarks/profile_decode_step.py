"""Where a decode step's time goes: per-kernel device times from a JAX profiler trace.

Builds the decode benchmark's model (random bf16 weights at a given shape), dispatches --steps
decode steps back to back under ``jax.profiler.trace`` and reads the trace back with
``jax.profiler.ProfileData``: the device's kernel events per step, grouped by kernel name.
Reported per step: the span from the first kernel's start to the last kernel's end, the time
kernels were busy, the idle gaps between kernels (launch latency the step did not hide), and the
kernels by total time with their counts, so a step that runs over its HBM floor can be split into
"slow kernels" and "gaps between kernels".

    python benchmarks/profile_decode_step.py --batch-size 1 --attention-backend pallas --out-dir $OUT
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from benchmarks.bench_decode import SHAPES, weight_bytes_read
from benchmarks.common import (
    add_backend_args,
    backend_kwargs,
    copy_bandwidth,
    environment,
    random_model,
    traced_kernel_events,
)
from dspark_jax.config import Qwen3Config
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.model_runner import round_up
from dspark_jax.forward_batch import build_forward_batch
from dspark_jax.sampling import SamplingParams, sampling_arrays


def summarize(events, steps: int, top: int, sequence: int = 0) -> dict:
    """Per-step accounting of kernel events; ``sequence`` > 0 also lists the first kernels of the
    last step in launch order (enough to read one decoder layer's kernels and their gaps)."""
    if not events:
        return {"error": "no device kernel events (CPU run, or the trace format changed)"}
    start = events[0][1]
    end = max(s + d for _, s, d in events)
    busy, last_end, gaps = 0.0, start, []
    for _, s, d in events:  # merge overlaps (several streams) into busy time
        if s > last_end:
            gaps.append(s - last_end)
        busy += max(0.0, s + d - max(s, last_end))
        last_end = max(last_end, s + d)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, _, d in events:
        by_name[name][0] += 1
        by_name[name][1] += d
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    gaps = np.asarray(gaps) if gaps else np.zeros(1)
    per_step = len(events) // steps
    last = events[len(events) - per_step:][:sequence] if sequence else []
    return {
        "kernels_per_step": len(events) / steps,
        "span_us_per_step": (end - start) / steps / 1e3,
        "busy_us_per_step": busy / steps / 1e3,
        "gap_us_per_step": float(gaps.sum()) / steps / 1e3,
        "median_gap_us": float(np.median(gaps)) / 1e3,
        "top_kernels": [{"name": n[:160], "calls_per_step": c / steps, "us_per_step": t / steps / 1e3,
                         "us_per_call": t / c / 1e3} for n, (c, t) in kernels[:top]],
        "sequence": [{"name": n[:160], "us": d / 1e3, "gap_before_us": (s - (ps + pd)) / 1e3 if i else 0.0}
                     for i, ((n, s, d), (_, ps, pd)) in enumerate(zip(last, last[:1] + last[:-1]))],
    }


def plain_decode_call(engine: Engine, bs: int, ctx: int):
    """A callable dispatching the plain engine's greedy decode step for bs requests at context ctx
    (synthetic pages, nothing committed: every call writes the same positions)."""
    ps = engine.pool.page_size
    B = round_up(bs, engine.decode_buckets)
    pages = [list(range(1 + i * engine.pages_per_seq, 1 + i * engine.pages_per_seq + -(-(ctx + 1) // ps)))
             for i in range(bs)]
    batch = jax.device_put(build_forward_batch([(np.array([5]), ctx, p) for p in pages], page_size=ps,
                                               num_tokens=B, num_seqs=B, pages_per_seq=engine.pages_per_seq))
    samp = jax.device_put(sampling_arrays([SamplingParams(max_new_tokens=1)] * bs, [0] * bs, [ctx] * bs, B))
    return lambda: engine.worker.run(batch, samp, "greedy")


def profile_calls(call, steps: int, top: int, sequence: int = 0, warmup: int = 3) -> dict:
    """summarize() of ``steps`` calls dispatched back to back under the profiler, after warmup."""
    return summarize(traced_kernel_events(call, steps, warmup), steps, top, sequence)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=160)
    add_backend_args(ap)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sequence", type=int, default=0, help="list the last step's first N kernels in launch order")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)

    env = environment()
    bw = copy_bandwidth()
    cfg = Qwen3Config(**SHAPES[args.shape], max_position_embeddings=40960, dtype="bfloat16")
    model = random_model(cfg)
    bs, ctx = args.batch_size, args.context
    engine = Engine(model, None, EngineConfig(max_running_requests=bs, max_model_len=ctx + 32, page_size=16,
                                              **backend_kwargs(args), precompile=False))
    summary = profile_calls(plain_decode_call(engine, bs, ctx), args.steps, args.top, args.sequence)
    floor_us = weight_bytes_read(cfg) / bw * 1e6
    payload = {"env": env, "shape": args.shape, "batch": bs, "context": ctx, "backend": engine.runner.backend,
               "norm_backend": engine.runner.norm_backend, "kv_write_backend": engine.runner.kv_write_backend,
               "copy_bandwidth_Bps": bw, "weights_floor_us": floor_us, **summary}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"decode_profile_{args.shape}_bs{bs}_{engine.runner.backend}{args.tag}"
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    md = [f"# Decode step profile: {args.shape}, batch {bs}, context {ctx}, attention {engine.runner.backend}, "
          f"norm {engine.runner.norm_backend}, kv write {engine.runner.kv_write_backend}\n",
          f"{env['device']}, jax {env['jax']}, {env['date']}, commit {env['commit']}; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s, weight floor {floor_us:.0f} us.\n"]
    if "error" in summary:
        md.append(summary["error"])
    else:
        md += [f"Per step: span {summary['span_us_per_step']:.0f} us, kernels busy {summary['busy_us_per_step']:.0f} us, "
               f"gaps {summary['gap_us_per_step']:.0f} us over {summary['kernels_per_step']:.0f} kernels "
               f"(median gap {summary['median_gap_us']:.2f} us).\n",
               "| kernel | calls/step | us/step | us/call |", "|---|---:|---:|---:|"]
        md += [f"| `{k['name'][:90]}` | {k['calls_per_step']:.0f} | {k['us_per_step']:.1f} | {k['us_per_call']:.2f} |"
               for k in summary["top_kernels"]]
        if summary["sequence"]:
            md += ["", "Launch order, last step:", "", "| # | kernel | us | gap before us |", "|---:|---|---:|---:|"]
            md += [f"| {i} | `{k['name'][:90]}` | {k['us']:.2f} | {k['gap_before_us']:.2f} |"
                   for i, k in enumerate(summary["sequence"])]
    (out_dir / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
