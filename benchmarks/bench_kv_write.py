"""H200 check and benchmark of the K/V cache write from the qkv projection (pallas_kernels/kv_write).

Why: between the qkv GEMM and the attention kernel of a batch-1 Qwen3-8B decode step XLA runs
six small kernels per layer (q / k norms and rope, the k and v scatters); the Pallas kernel does
them in one (see pallas_kernels/kv_write/kernel.py).  This measures one layer's write at decode and verify
sizes against the same math compiled by XLA, on a stacked cache the size of a serving pool.

Stages:

  check (always): kernel vs the jitted reference on the device for the 8B shape at T = 1, 16 and
      256 rows (bf16, stacked caches with a traced layer, padding rows in sentinel page 0), and
      for masked kv heads (Hkv = 3, fp32).  The written rows and q must match (bf16: at most 1%
      of elements one rounding step apart, 2e-2 tolerance; fp32: 1e-6) and nothing else may
      change; sentinel page 0 is not compared (padding rows may collide there, and colliding
      writes land in an unspecified order).  A failure stops the run (exit 2) before anything
      is timed.
  bench: per T in --rows, us per call of (a) the kernel, (b) the reference under XLA, each a
      write per jitted call, --calls calls (the caches donated and handed to the next call),
      device time from the kernels' durations in a profiler trace (wall time off the GPU); bytes = read q, k and v columns, weights and rope
      rows, write q, k and v; roofline = bytes / measured copy bandwidth; "XLA kernels / call" counts the
      launches in XLA's optimised HLO of one reference call.

Results: <out-dir>/kv_write_h200.json and .md.

    PYTHONPATH=. python3 benchmarks/bench_kv_write.py --out-dir $OUT          # on the GPU
    python benchmarks/bench_kv_write.py --interpret --smoke --out-dir /tmp/kvw  # CPU smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import copy_bandwidth, device_us_per_call, environment, exit_if_check_failed, write_results  # noqa: E402
from benchmarks.hlo_launches import count_launches  # noqa: E402
from dspark_jax.layers.rotary import rope_cos_sin  # noqa: E402
from pallas_kernels.kv_write import write_kv_from_qkv, write_kv_from_qkv_reference  # noqa: E402

EPS = 1e-6
SHAPE_8B = dict(H=32, Hk=8, D=128, L=36)


def log(*a):
    print(*a, flush=True)


def make_inputs(rng, T, H, Hk, D, L, pages, page_size, dtype, pad=0):
    """[k_pages, v_pages, qkv, k-norm stack, cos, sin, slots, q-norm stack]"""
    qkv = jnp.asarray(rng.standard_normal((T, (H + 2 * Hk) * D)) * 3, dtype)
    w = jnp.asarray(1 + 0.5 * rng.standard_normal((L, D)), dtype)
    qw = jnp.asarray(1 + 0.5 * rng.standard_normal((L, D)), dtype)
    cos, sin = rope_cos_sin(jnp.asarray(rng.integers(0, 30000, T)), D, 1e6)
    real = rng.choice(np.arange(page_size, pages * page_size), T - pad, replace=False)
    slots = jnp.asarray(np.concatenate([real, rng.integers(0, page_size, pad)]), jnp.int32)
    shape = (L, pages, page_size, Hk, D)
    k_pages = jax.random.normal(jax.random.PRNGKey(T), shape, dtype)
    v_pages = jax.random.normal(jax.random.PRNGKey(T + 1), shape, dtype)
    return [k_pages, v_pages, qkv, w, cos, sin, slots, qw]


def kernel_call(H, interpret):
    def f(kp, vp, qkv, w, cos, sin, slots, qw, layer):
        return write_kv_from_qkv(kp, vp, qkv, w, cos, sin, slots, num_q_heads=H, eps=EPS, layer=layer,
                                 q_norm_weight=qw, interpret=interpret)
    return f


def reference_call(H):
    def f(kp, vp, qkv, w, cos, sin, slots, qw, layer):
        return write_kv_from_qkv_reference(kp, vp, qkv, w, cos, sin, slots, num_q_heads=H, eps=EPS, layer=layer,
                                           q_norm_weight=qw)
    return f


def run_check(rng, interpret, smoke) -> list[dict]:
    cases = [(1, SHAPE_8B, jnp.bfloat16, 0), (16, SHAPE_8B, jnp.bfloat16, 3), (256, SHAPE_8B, jnp.bfloat16, 17),
             (7, dict(H=12, Hk=3, D=64, L=3), jnp.float32, 2)]
    if smoke:
        cases = [(3, dict(H=4, Hk=2, D=16, L=2), jnp.bfloat16, 1), (5, dict(H=6, Hk=3, D=32, L=3), jnp.float32, 2)]
    rows = []
    for T, s, dtype, pad in cases:
        args = make_inputs(rng, T, s["H"], s["Hk"], s["D"], s["L"], 64, 16, dtype, pad)
        layer = jnp.int32(s["L"] - 1)
        want = jax.jit(reference_call(s["H"]))(*args, layer)
        got = jax.jit(kernel_call(s["H"], interpret))(*args, layer)
        row = dict(T=T, **s, dtype=jnp.dtype(dtype).name, pad_rows=pad)
        for name, g, e, before in zip("kvq", got, want, args[:2] + [None]):
            g, e = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (g, e))
            compared = np.ones(g.shape[:-2], bool)
            if before is not None:
                b = np.asarray(jnp.asarray(before, jnp.float32))
                # page 0 is the padding rows' sentinel: two of them may share a slot and the
                # order of colliding writes is unspecified (XLA's scatter and the kernel alike)
                compared[:, 0] = False
                touched = compared & (np.any(e != b, axis=(-2, -1)) | np.any(g != b, axis=(-2, -1)))
                untouched_ok = bool(np.all(g[compared & ~touched] == b[compared & ~touched]))
            else:
                touched, untouched_ok = compared, True
            err = float(np.max(np.abs(g[touched] - e[touched])))
            mismatch = float(np.mean(g[touched] != e[touched]))
            if dtype == jnp.float32:  # different fp32 op order: rounding-level differences only
                ok = err <= 1e-6 * max(1.0, float(np.max(np.abs(e[touched]))))
            else:  # at most 1% of elements one bf16 rounding step apart
                ok = err <= 2e-2 * max(1.0, float(np.max(np.abs(e[touched])))) and mismatch <= 0.01
            row[name] = dict(max_abs_err=err, mismatch_fraction=mismatch, rows_compared=int(touched.sum()),
                             ok=bool(ok and untouched_ok))
        rows.append(row)
        log(f"check T={T} {s} {row['dtype']}: k {row['k']} v {row['v']} q {row['q']}")
    return rows


def us_per_call(fn, args, layer, n):
    """Device us per call of one jitted write (caches donated and handed back to the next call,
    as the engine's step does), from the GPU kernels' durations in a profiler trace
    (benchmarks.common.device_us_per_call): a chain of writes in one executable times the loop,
    or lets XLA merge the writes, rather than one write."""
    f = jax.jit(fn, donate_argnums=(0, 1))
    state, rest = list(args[:2]), args[2:]

    def call():
        out = f(*state, *rest, layer)
        state[:] = out[:2]
        return out

    return device_us_per_call(call, n)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--pages", type=int, default=2048, help="pages per layer of the stacked cache")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, with --interpret)")
    ap.add_argument("--name", default="kv_write_h200")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    env = environment()
    log(f"{env['device']}, jax {env['jax']}, commit {env['commit']}")
    check = run_check(rng, args.interpret, args.smoke)
    exit_if_check_failed(all(r[x]["ok"] for r in check for x in "kvq"), args.name, env, check, args.out_dir)
    s = dict(H=4, Hk=2, D=16, L=2) if args.smoke else SHAPE_8B
    pages = 8 if args.smoke else args.pages
    rows_arg = [1, 3] if args.smoke else args.rows
    calls = 2 if args.smoke else args.calls
    bw = 1e9 if args.smoke else copy_bandwidth()
    rows = []
    for T in rows_arg:
        inputs = make_inputs(rng, T, s["H"], s["Hk"], s["D"], s["L"], pages, 16, jnp.bfloat16)
        layer = jnp.int32(s["L"] // 2)
        kern, method = us_per_call(kernel_call(s["H"], args.interpret), inputs, layer, calls)
        inputs = make_inputs(rng, T, s["H"], s["Hk"], s["D"], s["L"], pages, 16, jnp.bfloat16)
        xla, _ = us_per_call(reference_call(s["H"]), inputs, layer, calls)
        hlo = jax.jit(reference_call(s["H"])).lower(*inputs, layer).compile().as_text()
        # read q, k, v and the rope rows, write q, k, v, read both norm weights
        nbytes = T * ((2 * s["H"] + 4 * s["Hk"]) * s["D"] * 2 + 2 * s["D"] * 4) + 2 * s["D"] * 2
        row = dict(T=T, kernel_us=kern, xla_us=xla, xla_over_kernel=xla / kern, xla_kernels_per_call=count_launches(hlo).total,
                   bytes=nbytes, roofline_us=nbytes / bw * 1e6)
        rows.append(row)
        log(row)
    md = ["# K/V write (and q's norm + rope) from the qkv projection: Pallas kernel vs XLA\n",
          f"{env['device']}, jax {env['jax']}, {env['date']}, commit {env['commit']}; Hq {s['H']}, Hkv {s['Hk']}, "
          f"D {s['D']}, bf16, stacked cache of {s['L']} layers x {pages} pages of 16; copy bandwidth {bw / 1e12:.2f} TB/s. "
          f"us per call: {method} over {calls} calls (one write per executable).\n",
          "| rows | kernel us | XLA us | XLA / kernel | XLA kernels / call | bytes | roofline us |",
          "|---:|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {r['T']} | {r['kernel_us']:.2f} | {r['xla_us']:.2f} | {r['xla_over_kernel']:.2f} | "
           f"{r['xla_kernels_per_call']} | {r['bytes']} | {r['roofline_us']:.3f} |" for r in rows]
    payload = dict(env=env, shape=s, pages=pages, copy_bandwidth_Bps=bw, check=check, rows=rows, timing=method,
                   interpret=args.interpret, status="complete")
    for p in write_results(args.name, payload, "\n".join(md) + "\n", args.out_dir or ["runs/kv-write"]):
        log(f"wrote {p}")
    log("\n".join(md))


if __name__ == "__main__":
    main()
