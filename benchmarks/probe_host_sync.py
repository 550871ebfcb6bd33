"""Does dispatching an executable block the host until the device reaches it?

The engines rely on the host running ahead of the device: step t+1 is dispatched while step t
runs.  An executable whose control flow the runtime drives from the host (an XLA while loop whose
trip count it reads back, a conditional whose predicate it copies to the host) cannot be
dispatched that way: its call returns only once the device has worked through everything queued
before it.  This probe queues a long device op (a chain of matmuls, ``--busy-ms`` long) and then
times the *call* of each candidate behind it:

* ``scan``: a layer loop under ``lax.scan`` (as the engines' prefill runs its layers);
* ``unrolled``: the same loop unrolled (as decode steps and speculative rounds run);
* ``cond``: ``lax.cond`` on a device value (as ``sampling.sample``'s "any" variant).

A call that takes about ``--busy-ms`` blocked; one that takes microseconds did not.

    python benchmarks/probe_host_sync.py --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, write_results


def candidates(layers: int):
    def layer(x, w):
        return jnp.tanh(x @ w), None

    def scan(x, ws):
        return jax.lax.scan(layer, x, ws)[0]

    def unrolled(x, ws):
        for i in range(layers):
            x = layer(x, ws[i])[0]
        return x

    def cond(x, ws):
        return jax.lax.cond(x.sum() > 0, lambda v: v * 2.0, lambda v: v - 1.0, unrolled(x, ws))

    return {"scan": scan, "unrolled": unrolled, "cond": cond}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy-ms", type=float, default=50.0, help="device time queued ahead of each call")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)
    env = environment()
    key = jax.random.PRNGKey(0)
    n = 4096
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    busy_step = jax.jit(lambda m: (m @ a) * (1.0 / n))
    # calibrate the busy chain to about --busy-ms of device time
    m = busy_step(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        m = busy_step(m)
    m.block_until_ready()
    per = (time.perf_counter() - t0) / 10
    reps = max(1, int(args.busy_ms / 1e3 / per))
    x = jax.random.normal(key, (8, 256), jnp.float32)
    ws = jax.random.normal(key, (args.layers, 256, 256), jnp.float32) * 0.05
    rows = []
    for name, fn in candidates(args.layers).items():
        f = jax.jit(fn)
        f(x, ws).block_until_ready()  # compile
        calls, totals = [], []
        for _ in range(args.repeats):
            m = a
            for _ in range(reps):  # queue the busy work
                m = busy_step(m)
            t0 = time.perf_counter()
            y = f(x, ws)
            t1 = time.perf_counter()
            jax.block_until_ready((y, m))
            calls.append((t1 - t0) * 1e3)
            totals.append((time.perf_counter() - t0) * 1e3)
        rows.append({"candidate": name, "call_ms": float(np.median(calls)), "call_to_done_ms": float(np.median(totals))})
        print(rows[-1], flush=True)
    busy = reps * per * 1e3
    md = [f"# Host blocking at dispatch ({env['device']}, jax {env['jax']}, {env['date']}, commit {env['commit']})\n",
          f"Each candidate is called behind ~{busy:.1f} ms of queued device work (matmul chain); median of "
          f"{args.repeats}. A call near that figure blocked the host until the device reached it.\n",
          "| candidate | call ms | call to done ms |", "|---|---:|---:|"]
    md += [f"| {r['candidate']} | {r['call_ms']:.3f} | {r['call_to_done_ms']:.1f} |" for r in rows]
    write_results("probe_host_sync", {"env": env, "busy_ms": busy, "rows": rows}, "\n".join(md) + "\n", args.out_dir)
    print("\n".join(md))


if __name__ == "__main__":
    main()
