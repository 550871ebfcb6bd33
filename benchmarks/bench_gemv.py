"""H200 check, tuning and benchmark of the small-batch projection kernel (pallas_kernels/gemv).

Why: XLA runs each batch-1 projection of an 8B decoder layer as a split-K GEMM plus a reduction
kernel, and the SwiGLU product as a kernel of its own, at 70-80% of the bandwidth on the narrower
projections (see pallas_kernels/gemv/kernel.py).  This measures the kernel against XLA on the four
projections of a Qwen3-8B layer, with the weights in a stacked [L, K, N] array as the model holds
them.

Stages:

  check (always): kernel vs the jitted reference for each projection at M = 1, 16 and 64 (bf16,
      stacked weights, traced layer): within 2e-2 relative and no further from a float64 result
      than XLA is.  A failure stops the run (exit 2) before anything is timed.
  tune (--tune): device us per call for a list of tile configurations at M = 1 per projection.
  bench: per projection and M in --rows, device us per call of the kernel (default tiles, or the
      best tuned ones with --tune) and of XLA (``jnp.dot`` on a static layer slice, as the
      unrolled decode step reads it; the down projection includes XLA's SwiGLU product), from
      the kernels' durations in a profiler trace (benchmarks.common.device_us_per_call); bytes =
      the layer's weights + activations in + out; roofline = bytes / measured copy bandwidth.

Results: <out-dir>/gemv_h200.json and .md.

    PYTHONPATH=. python3 benchmarks/bench_gemv.py --tune --out-dir $OUT          # on the GPU
    python benchmarks/bench_gemv.py --interpret --smoke --out-dir /tmp/gemv        # CPU smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (copy_bandwidth, device_us_per_call, environment,  # noqa: E402
                               exit_if_check_failed, write_results)
from pallas_kernels.gemv import block_config, gemv, gemv_reference, kernel_supports  # noqa: E402

# (name, K, N, prologue) of a Qwen3-8B layer; the down projection reads the [M, 2K] gate/up output
SHAPES_8B = [("qkv", 4096, 6144, "none"), ("o", 4096, 4096, "none"), ("gate_up", 4096, 24576, "none"),
             ("down", 12288, 4096, "swiglu"), ("down_plain", 12288, 4096, "none")]  # down_plain: SwiGLU left to XLA
SHAPES_SMOKE = [("qkv", 128, 192, "none"), ("down", 256, 128, "swiglu")]
TUNE = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s) for bn, bk, w, s in (
    (32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 4), (64, 256, 4, 3), (64, 64, 4, 6), (32, 256, 4, 5),
    (64, 128, 8, 4), (128, 64, 4, 5), (32, 512, 4, 3), (16, 256, 4, 4), (16, 512, 2, 4), (16, 1024, 4, 3),
    (32, 256, 8, 4))]
# stacked layers, as many as the 8B model has: its gate/up stack (7.2 GB) needs 64-bit offsets in the
# kernel, which changes its register use, so a short stack would time another kernel
LAYERS = 36


def log(*a):
    print(*a, flush=True)


def inputs(rng, M, K, N, prologue, layers):
    x = jnp.asarray(rng.standard_normal((M, 2 * K if prologue == "swiglu" else K)), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(K + N), (layers, K, N), jnp.bfloat16) * (K ** -0.5)
    return x, w


def run_check(rng, shapes, rows, interpret, layers) -> list[dict]:
    out = []
    for name, K, N, prologue in shapes:
        for M in rows:
            x, w = inputs(rng, M, K, N, prologue, layers)
            layer = jnp.int32(layers - 1)
            want = jax.jit(lambda x, w, l: gemv_reference(x, w, layer=l, prologue=prologue))(x, w, layer)
            got = jax.jit(lambda x, w, l: gemv(x, w, layer=l, prologue=prologue, interpret=interpret))(x, w, layer)
            g, e = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (got, want))
            xs = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
            if prologue == "swiglu":
                xs = xs[:, :K] / (1 + np.exp(-xs[:, :K])) * xs[:, K:]
            truth = xs @ np.asarray(jnp.asarray(w[layers - 1], jnp.float32), np.float64)
            err, err_ref = float(np.mean(np.abs(g - truth))), float(np.mean(np.abs(e - truth)))
            ok = bool(np.allclose(g, e, rtol=2e-2, atol=2e-2 * max(1.0, float(np.max(np.abs(e)))))
                      and err <= 1.5 * err_ref + 1e-6)
            out.append(dict(proj=name, M=M, mean_abs_err_vs_f64=err, xla_mean_abs_err_vs_f64=err_ref, ok=ok))
            log(f"check {name} M={M}: {out[-1]}")
    return out


def time_kernel(x, w, prologue, layer, calls, interpret, **tiles):
    f = jax.jit(lambda x, w: gemv(x, w, layer=layer, prologue=prologue, interpret=interpret, **tiles))
    return device_us_per_call(lambda: f(x, w), calls)[0]


def time_xla(x, w, prologue, layer, calls):
    # a static layer slice, as the unrolled decode step reads it (in place)
    f = jax.jit(lambda x, w: gemv_reference(x, w[layer], prologue=prologue))
    return device_us_per_call(lambda: f(x, w), calls)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--shapes", nargs="+", help="projections to run (default: all of the 8B layer's)")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, with --interpret)")
    ap.add_argument("--name", default="gemv_h200")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    env = environment()
    log(f"{env['device']}, jax {env['jax']}, commit {env['commit']}")
    shapes = SHAPES_SMOKE if args.smoke else SHAPES_8B
    if args.shapes:
        unknown = set(args.shapes) - {s[0] for s in shapes}
        if unknown:
            ap.error(f"unknown --shapes {sorted(unknown)}; choose from {[s[0] for s in shapes]}")
        shapes = [s for s in shapes if s[0] in args.shapes]
    layers = 2 if args.smoke else LAYERS
    check = run_check(rng, shapes, [1, 3] if args.smoke else [1, 16, 64], args.interpret, layers)
    exit_if_check_failed(all(c["ok"] for c in check), args.name, env, check, args.out_dir)
    calls = 2 if args.smoke else args.calls
    bw = 1e9 if args.smoke else copy_bandwidth()
    best, tune_rows = {}, []
    layer = layers // 2
    for name, K, N, prologue in shapes:
        x, w = inputs(rng, 1, K, N, prologue, layers)
        # a candidate must fit every M it is then benchmarked at (shared memory grows with block_m)
        cands = [c for c in (TUNE if args.tune else [])
                 if all(kernel_supports(M, K, N, block_config(M, K, N, **c), prologue=prologue)
                        for M in ([1, 3] if args.smoke else args.rows))]
        timed = [(time_kernel(x, w, prologue, layer, calls, args.interpret, **c), c) for c in cands]
        for us, c in timed:
            tune_rows.append(dict(proj=name, us=us, **c))
            log(f"tune {name}: {c} {us:.2f} us")
        best[name] = min(timed, key=lambda t: t[0])[1] if timed else {}
    rows = []
    for name, K, N, prologue in shapes:
        for M in ([1, 3] if args.smoke else args.rows):
            x, w = inputs(rng, M, K, N, prologue, layers)
            kern = time_kernel(x, w, prologue, layer, calls, args.interpret, **best[name])
            xla, method = time_xla(x, w, prologue, layer, calls)
            nbytes = 2 * (K * N + x.size + M * N)
            cfg = block_config(M, K, N, **best[name])
            rows.append(dict(proj=name, M=M, K=K, N=N, kernel_us=kern, xla_us=xla, xla_over_kernel=xla / kern,
                             bytes=nbytes, roofline_us=nbytes / bw * 1e6, kernel_pct_bw=nbytes / bw * 1e6 / kern * 100,
                             tiles=dict(block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k,
                                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
            log(rows[-1])
    md = ["# Small-batch projections: GEMV kernel vs XLA\n",
          f"{env['device']}, jax {env['jax']}, {env['date']}, commit {env['commit']}; bf16, weights in a "
          f"[{layers}, K, N] stack; copy bandwidth {bw / 1e12:.2f} TB/s; us per call: {method} over {calls} calls. "
          "The down projection's input is the [M, 2K] gate/up output (SwiGLU inside the kernel; XLA runs it "
          "as its own kernel, included in its time).\n",
          "| projection | M | K | N | kernel us | XLA us | XLA / kernel | roofline us | kernel % of copy BW | tiles |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    md += [f"| {r['proj']} | {r['M']} | {r['K']} | {r['N']} | {r['kernel_us']:.2f} | {r['xla_us']:.2f} | "
           f"{r['xla_over_kernel']:.2f} | {r['roofline_us']:.2f} | {r['kernel_pct_bw']:.0f} | "
           f"bn{r['tiles']['block_n']} bk{r['tiles']['block_k']} w{r['tiles']['num_warps']} s{r['tiles']['num_stages']} |"
           for r in rows]
    payload = dict(env=env, layers=layers, copy_bandwidth_Bps=bw, check=check, tune=tune_rows, best_tiles=best,
                   rows=rows, timing=method, interpret=args.interpret, status="complete")
    for p in write_results(args.name, payload, "\n".join(md) + "\n", args.out_dir or ["runs/gemv"]):
        log(f"wrote {p}")
    log("\n".join(md))


if __name__ == "__main__":
    main()
