"""H200 benchmark (and GPU correctness check) of the fused residual-add + RMSNorm kernel.

Measures what the fused Pallas (Triton) kernel costs against the same computation left to XLA
(several launch-bound kernels per norm), at decode sizes: T = 1, 4, 16, 64, 256 rows of
d = 4096 (bf16).

Stages (flags):

  check (always, unless --no-check): kernel vs the jitted jnp reference (XLA on the device) and
      vs a host numpy evaluation of the jnp program op by op (immune to XLA rewrites), for
      d in 2048/4096/8192, bf16 and fp32, default tiles and masked tails.  new_residual must be
      bit-exact and normed within 1e-5 x magnitude (fp32) or 2e-2 (bf16) against both; against
      the numpy evaluation, which pins the semantics, at most 1% of bf16 elements may differ
      (a rounding step flipped by summation order).  In interpret mode the kernel body is
      compiled by XLA:CPU, which normalises the unrounded fp32 sum (excess precision; see
      tests/test_fused_add_rms_norm.py), so there the 1% rule applies to the XLA comparison
      instead.  A failure stops the run (exit 2) before anything is timed.
  bench (always): per (T, d), time
      (a) the fused kernel (its tiling: pallas_kernels/fused_add_rms_norm/kernel.py),
      (b) the same math as plain jnp compiled by XLA (``fused_add_rms_norm_reference``),
      (c) a launch floor: one tiny XLA elementwise kernel per call,
      each as a chain of ``--calls`` calls inside one jit (each call's outputs are the next
      call's inputs, x <- normed, residual <- new_residual, with an optimization barrier between
      calls so XLA cannot fuse one call's tail into the next call's head, as the decoder's
      matmuls would not let it).  Those executables are dispatched back to back with
      ``benchmarks.common.time_chain`` (median over repetitions); us per call = that / calls.
      Bytes moved = read x, residual, weight + write normed, new_residual; roofline = bytes /
      device copy bandwidth measured by ``benchmarks.common.copy_bandwidth``.  "XLA kernels /
      call" counts fusion and custom-call instructions in XLA's optimised HLO of one call.

Results: <out-dir>/fused_add_rms_norm_h200.json and .md (``--name`` to change).

Run on the GPU machine:

    PYTHONPATH=. python3 benchmarks/bench_fused_add_rms_norm.py --out-dir $OUT

CPU smoke test of this script (interpret mode, tiny sizes; do not write into benchmarks/results):

    python benchmarks/bench_fused_add_rms_norm.py --interpret --smoke --out-dir /tmp/farn
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import benchmarks.common as common  # noqa: E402
from benchmarks.common import copy_bandwidth, environment, time_chain  # noqa: E402
from benchmarks.hlo_launches import count_launches  # noqa: E402
from pallas_kernels.fused_add_rms_norm import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    tile_config,
)

EPS = 1e-6
NAME = "fused_add_rms_norm_h200"
DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- inputs / semantics


def make_inputs(rng, T, d, dtype):
    """x ~ N(0, 1); residual with per-row scales in [0.1, 30]; weight ~ 1 + 0.5 N(0, 1)."""
    x = rng.standard_normal((T, d)).astype(np.float32)
    scale = np.exp(rng.uniform(np.log(0.1), np.log(30.0), size=(T, 1))).astype(np.float32)
    r = (scale * rng.standard_normal((T, d))).astype(np.float32)
    w = (1.0 + 0.5 * rng.standard_normal(d)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(r, dtype), jnp.asarray(w, dtype)


def numpy_literal(x, r, w, eps):
    """The jnp program evaluated op by op on the host (ml_dtypes for bf16): the sum is rounded to
    the input dtype before the norm, the normalised row before the weight multiply."""
    dt = np.asarray(x).dtype
    xf, rf, wf = (np.asarray(a).astype(np.float32) for a in (x, r, w))
    h = (xf + rf).astype(dt).astype(np.float32)
    n = h * (1.0 / np.sqrt((h * h).mean(-1, keepdims=True, dtype=np.float64) + eps))
    n = n.astype(np.float32).astype(dt).astype(np.float32)
    return (wf * n).astype(dt).astype(np.float32), h


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def compare(got_normed, got_res, want_normed, want_res, dtype, *, max_mismatch=0.01):
    """(ok, stats) for one comparison under the tolerances in the module docstring
    (``max_mismatch``: share of bf16 elements allowed to differ at all; None: not enforced)."""
    g, e = _f32(got_normed), _f32(want_normed)
    err = float(np.max(np.abs(g - e))) if g.size else 0.0
    scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
    mismatch = float(np.mean(g != e)) if g.size else 0.0
    res_exact = bool(np.array_equal(_f32(got_res), _f32(want_res)))
    finite = bool(np.isfinite(g).all())
    if dtype == jnp.float32:
        ok = err <= 1e-5 * scale
    else:
        ok = bool(np.allclose(g, e, atol=2e-2, rtol=2e-2))
        ok = ok and (max_mismatch is None or mismatch <= max_mismatch)
    return ok and res_exact and finite, dict(
        max_abs_err=err, rel_err=err / scale, mismatch_frac=mismatch, residual_exact=res_exact,
        finite=finite)


# --------------------------------------------------------------------------- check


def run_check(args, rng) -> tuple[bool, list[dict]]:
    if args.smoke:
        cells = [(1, 256, "bf16"), (3, 256, "fp32"), (5, 64, "bf16")]
    else:
        cells = [(T, d, dt) for dt in ("bf16", "fp32") for d in (256, 1024, 2048, 4096, 8192)
                 for T in (1, 3, 17, 64, 256)]
    ref = jax.jit(fused_add_rms_norm_reference, static_argnames=("eps",))
    rows, all_ok = [], True
    for T, d, dt in cells:
        dtype = DTYPES[dt]
        x, r, w = make_inputs(rng, T, d, dtype)
        kn, kr = fused_add_rms_norm(x, r, w, eps=EPS, interpret=args.interpret)
        xn, xr = ref(x, r, w, eps=EPS)
        ln, lr = numpy_literal(x, r, w, EPS)
        # The 1% rule holds against the evaluation that rounds like the kernel: numpy on the
        # GPU (Triton rounds the sum), XLA in interpret mode (both skip the rounding there).
        ok_x, st_x = compare(kn, kr, xn, xr, dtype, max_mismatch=0.01 if args.interpret else None)
        ok_l, st_l = compare(kn, kr, ln, lr, dtype, max_mismatch=None if args.interpret else 0.01)
        _, st_xl = compare(xn, xr, ln, lr, dtype)  # XLA vs literal: reported, not enforced
        ok = ok_x and ok_l
        all_ok &= ok
        cfg = tile_config(T, d)
        rows.append(dict(T=T, d=d, dtype=dt, block_rows=cfg.block_rows, num_warps=cfg.num_warps,
                         ok=ok, vs_xla=st_x, vs_literal=st_l, xla_vs_literal=st_xl))
        log(f"check T={T:4d} d={d:5d} {dt} br={cfg.block_rows} warps={cfg.num_warps}: "
            f"{'ok' if ok else 'FAIL'}  vs XLA err {st_x['max_abs_err']:.2e} "
            f"mism {st_x['mismatch_frac']:.4f} | vs literal err {st_l['max_abs_err']:.2e} "
            f"mism {st_l['mismatch_frac']:.4f} | XLA vs literal mism {st_xl['mismatch_frac']:.4f}")
    return all_ok, rows


# --------------------------------------------------------------------------- timing


def _barrier(*xs):
    return jax.lax.optimization_barrier(xs)


def build_chain(fn, n):
    """One executable running ``fn`` n times, outputs feeding inputs, a barrier between calls."""

    @jax.jit
    def chain(x, r, w):
        for _ in range(n):
            normed, r = fn(x, r, w)
            x, r = _barrier(normed.astype(x.dtype), r)
        return x, r

    return chain


def kernel_fn(interpret):
    def fn(x, r, w):
        return fused_add_rms_norm(x, r, w, eps=EPS, interpret=interpret)
    return fn


def xla_fn(x, r, w):
    return fused_add_rms_norm_reference(x, r, w, eps=EPS)


def floor_fn(x, r, w):
    """One tiny elementwise kernel per call (a 1-element update): launch + minimal work."""
    return x, r.at[:1, :1].multiply(1.0001)


def time_per_call(fn, inputs, n, execs, reps) -> float:
    chain = build_chain(fn, n)
    jax.block_until_ready(chain(*inputs))  # compile + first run
    return time_chain(lambda: chain(*inputs), execs, warmup=2, reps=reps) / n


def xla_kernels_per_call(x, r, w) -> int | None:
    """Kernels XLA launches for one reference call (benchmarks/hlo_launches.py)."""
    try:
        return count_launches(jax.jit(xla_fn).lower(x, r, w).compile().as_text()).total
    except Exception:  # pragma: no cover - backend without HLO text
        return None


def nbytes(T, d, dtype) -> int:
    s = jnp.dtype(dtype).itemsize
    return s * (2 * T * d + d) + s * 2 * T * d


def run_bench(args, rng, bw) -> list[dict]:
    rows = []
    dtype = DTYPES[args.dtype]
    for d in args.dims:
        for T in args.rows:
            x, r, w = make_inputs(rng, T, d, dtype)
            cfg = tile_config(T, d)
            t_k = time_per_call(kernel_fn(args.interpret), (x, r, w), args.calls, args.execs,
                                args.reps)
            t_x = time_per_call(xla_fn, (x, r, w), args.calls, args.execs, args.reps)
            t_f = time_per_call(floor_fn, (x, r, w), args.calls, args.execs, args.reps)
            b = nbytes(T, d, dtype)
            roof = b / bw
            row = dict(T=T, d=d, dtype=args.dtype, block_rows=cfg.block_rows,
                       num_warps=cfg.num_warps, grid=cfg.grid[0], fused_us=t_k * 1e6,
                       xla_us=t_x * 1e6, launch_floor_us=t_f * 1e6, speedup=t_x / t_k,
                       xla_kernels_per_call=xla_kernels_per_call(x, r, w), bytes=b,
                       roofline_us=roof * 1e6, fused_over_roofline=t_k / roof)
            rows.append(row)
            log(f"bench T={T:4d} d={d}: fused {row['fused_us']:.2f} us, XLA {row['xla_us']:.2f} us "
                f"({row['xla_kernels_per_call']} kernels), floor {row['launch_floor_us']:.2f} us, "
                f"roofline {row['roofline_us']:.3f} us")
    return rows


# --------------------------------------------------------------------------- results


def markdown(env, args, bw, check_ok, bench) -> str:
    md = [
        "# Fused residual add + RMSNorm (Pallas Triton) vs XLA\n",
        f"{env['device']}, jax {env['jax']}, {env['date']}, commit {env['commit']}"
        f"{' (INTERPRET MODE: timings meaningless)' if args.interpret else ''}; "
        f"measured copy bandwidth {bw / 1e12:.2f} TB/s; check {'passed' if check_ok else 'SKIPPED/FAILED'}.\n",
        f"Each figure: us per call, median over {args.reps} repetitions of {args.execs} executables "
        f"of {args.calls} chained calls (outputs feed inputs, optimization barrier between calls). "
        "XLA = the same math as plain jnp compiled by XLA; launch floor = one tiny XLA elementwise "
        "kernel per call; bytes = read x, residual, weight + write normed, new_residual; "
        "roofline = bytes / copy bandwidth.\n",
        "| T | d | dtype | tile (rows x d, warps) | fused us | XLA us | XLA kernels/call | XLA / fused "
        "| launch floor us | bytes | roofline us | fused / roofline |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in bench:
        md.append(
            f"| {r['T']} | {r['d']} | {r['dtype']} | {r['block_rows']}x{r['d']}, {r['num_warps']} "
            f"| {r['fused_us']:.2f} | {r['xla_us']:.2f} | {r['xla_kernels_per_call']} "
            f"| {r['speedup']:.2f} | {r['launch_floor_us']:.2f} | {r['bytes']} "
            f"| {r['roofline_us']:.3f} | {r['fused_over_roofline']:.1f} |")
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(common.RESULTS))
    ap.add_argument("--name", default=NAME)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--dims", type=int, nargs="+", default=[4096])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--calls", type=int, default=64, help="chained calls per executable")
    ap.add_argument("--execs", type=int, default=10, help="executables per timed repetition")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: proves the script runs")
    args = ap.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.interpret:
        log("no GPU: running the Pallas kernel in interpret mode (--interpret)")
        args.interpret = True
    if args.smoke:
        args.rows, args.dims = [1, 3], [256]
        args.calls, args.execs, args.reps = 3, 2, 2
    env = environment()
    rng = np.random.default_rng(0)
    payload = dict(env=env, args=vars(args), eps=EPS)

    check_ok, check_rows = True, []
    if not args.no_check:
        check_ok, check_rows = run_check(args, rng)
        payload.update(check_ok=check_ok, check=check_rows)
        if not check_ok:
            payload["status"] = "check failed: nothing timed"
            for p in common.write_results(args.name, payload, "# fused_add_rms_norm: CHECK FAILED\n", [args.out_dir]):
                log("wrote", p)
            return 2
    if on_gpu:
        common.gpu_warmup(1.0, 4096)
    bw = copy_bandwidth(1 << 22 if args.smoke else 4 << 30)
    payload["copy_bandwidth_Bps"] = bw
    log(f"{env['device']} jax {env['jax']}: copy bandwidth {bw / 1e12:.3f} TB/s")
    bench_rows = run_bench(args, rng, bw)
    payload.update(bench=bench_rows, status="ok")
    md = markdown(env, args, bw, check_ok and not args.no_check, bench_rows)
    for p in common.write_results(args.name, payload, md, [args.out_dir]):
        log("wrote", p)
    log(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
