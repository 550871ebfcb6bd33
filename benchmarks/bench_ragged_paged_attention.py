"""H200 benchmark (and GPU correctness check) of the ragged paged attention kernel.

Stages, selected by flags (default: all three):

  --check  kernel vs reference on the GPU for a handful of shapes (fp32 / bf16, GQA 1/4/8,
           head_dim 64/128, page sizes 8/16/32, stacked layers, splits on/off, poisoned
           sentinel page and padding rows).  Exits non-zero on a failure before timing anything.
  --tune   small sweep of block_n / num_warps / num_stages and of the split heuristic on a few
           representative cells; the best settings are used by --bench (and printed).
  --bench  decode (q_len 1) and verify (q_len 4, 8) for batch x context, Qwen3-8B-like heads
           (Hq 32, Hkv 8, D 128, bf16), beside the jnp reference compiled by XLA and the HBM
           floor (K/V bytes / measured device copy bandwidth).

Timing: each timed executable chains ``n`` calls (each call's output is the next call's q, so
nothing can be hoisted or deduplicated) inside one jit; the time per call is the median over
several repetitions of (wall time / n) after a warm-up, synchronised with block_until_ready.
Results: <out>/ragged_paged_attention_h200.json and .md.

Run on the GPU machine:  PYTHONPATH=. python3 benchmarks/bench_ragged_paged_attention.py \
    --out $OUT --git-commit <sha>

Ratio mode (``--ratio``, runs alone, ~3 minutes on the H200): verify (q_len 4 and 8) against
decode (q_len 1) at batch 1/4/8/16 and context 2k/8k/32k on a 48 GiB K+V page pool (each of K
and V past 4 GiB, so Pallas uses int64 offsets, as a real cache does), for every kernel arm in
``RATIO_ARMS`` (decode knobs, verify knobs).  First every arm is checked against the jnp
reference on a ragged batch from the same pool (causal and causal=False, split and unsplit,
NaN sentinel page and NaN padding rows); then in every timed cell the first call's output of
each arm is compared with the base arm's (and the base arm with the reference where that fits
in memory) before the arm is timed.  A mismatch stops the run with exit code 2 and the status
in the results.  Results: PREFIX.json and PREFIX.md (``--ratio-out``, default
<out>/ragged_paged_attention_h200_ratio).  ``--smoke`` runs the same code on CPU in interpret
mode with tiny sizes:

    PYTHONPATH=. python3 benchmarks/bench_ragged_paged_attention.py --ratio --out $OUT \
        --git-commit <sha>
    PYTHONPATH=. python benchmarks/bench_ragged_paged_attention.py --smoke --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    def tqdm(x, **_):
        return x

from benchmarks.common import gpu_warmup  # noqa: E402
from pallas_kernels.ragged_paged_attention.layout import pages_needed, ragged_metadata  # noqa: E402
from pallas_kernels.ragged_paged_attention.kernel import (  # noqa: E402
    block_config,
    ragged_paged_attention,
)
from pallas_kernels.ragged_paged_attention.reference import (  # noqa: E402
    ragged_paged_attention_reference,
)

HQ, HKV, D = 32, 8, 128
INTERPRET = False  # --interpret: CPU smoke test of this script (tiny shapes only)


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- problems


def make_problem(rng, q_lens, kv_lens, *, hq, hkv, d, page_size, dtype, num_pages=None,
                 extra_seqs=0, pad_rows=0, layers=None, pages_per_seq=None, poison=True):
    """Random ragged problem on the default device; pages shuffled; page 0 is the sentinel."""
    q_lens = np.asarray(q_lens, np.int32)
    kv_lens = np.asarray(kv_lens, np.int32)
    ns = len(q_lens)
    need = pages_needed(kv_lens, page_size)
    total = int(sum(need))
    N = num_pages or total + 1
    # unused table entries -> sentinel page 0
    table, cu, kvl = ragged_metadata(q_lens, kv_lens, rng.permutation(np.arange(1, N))[:total], num_slots=ns + extra_seqs,
                                     pages_per_seq=pages_per_seq or max(need), page_size=page_size)
    T = int(cu[ns]) + pad_rows
    shape = (N, page_size, hkv, d) if layers is None else (layers, N, page_size, hkv, d)
    k = rng.standard_normal(shape, np.float32)
    v = rng.standard_normal(shape, np.float32)
    q = rng.standard_normal((T, hq, d), np.float32)
    if poison:
        if layers is None:
            k[0] = np.nan
            v[0] = np.nan
        else:
            k[:, 0] = np.nan
            v[:, 0] = np.nan
        q[cu[ns]:] = np.nan
    return dict(
        q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype),
        kv_lens=jnp.asarray(kvl), page_table=jnp.asarray(table), cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.int32(ns), rows=int(cu[ns]),
    )


def _args(p):
    return (p["q"], p["k"], p["v"], p["kv_lens"], p["page_table"], p["cu_q_lens"], p["num_seqs"])


# --------------------------------------------------------------------------- check


def run_check(rng) -> bool:
    log("== GPU correctness: kernel vs reference (fp32 reference math, matmul precision highest)")
    cases = [
        # name, q_lens, kv_lens, hq, hkv, d, page_size, dtype, layers, knobs
        ("bf16 gqa4 d128 mixed", [1, 3, 8, 1, 40, 5], [37, 300, 129, 1, 200, 64], 32, 8, 128, 16,
         jnp.bfloat16, None, {}),
        ("bf16 gqa4 d128 nosplit", [1, 3, 8, 1, 40, 5], [37, 300, 129, 1, 200, 64], 32, 8, 128, 16,
         jnp.bfloat16, None, {"num_splits": 1}),
        ("fp32 gqa1 d64 ps8", [2, 1, 7, 64, 4], [50, 9, 300, 120, 77], 4, 4, 64, 8,
         jnp.float32, None, {}),
        ("fp32 gqa8 d128 ps32 split3", [1, 8, 2, 16], [500, 33, 260, 90], 16, 2, 128, 32,
         jnp.float32, None, {"num_splits": 3}),
        ("bf16 gqa8 d64 stacked", [4, 1, 6, 1, 30], [100, 250, 17, 400, 64], 16, 2, 64, 16,
         jnp.bfloat16, 3, {}),
        ("bf16 gqa4 d128 decode32", [1] * 32, list(rng.integers(1, 2048, 32)), 32, 8, 128, 16,
         jnp.bfloat16, None, {}),
        ("bf16 gqa4 d128 verify8x16 bn128", [8] * 16, list(rng.integers(8, 2048, 16)), 32, 8, 128,
         16, jnp.bfloat16, None, {"block_n": 128, "num_warps": 8}),
    ]
    ok = True
    for name, ql, kl, hq, hkv, d, ps, dt, layers, knobs in cases:
        p = make_problem(rng, ql, kl, hq=hq, hkv=hkv, d=d, page_size=ps, dtype=dt, extra_seqs=2,
                         pad_rows=5, layers=layers)
        kw = dict(sm_scale=1.0 / math.sqrt(d))
        if layers is not None:
            kw["layer"] = jnp.int32(layers - 2)
        out = ragged_paged_attention(*_args(p), **kw, **knobs, interpret=INTERPRET)
        with jax.default_matmul_precision("highest"):
            ref = jax.jit(ragged_paged_attention_reference,
                          static_argnames=("sm_scale",))(*_args(p), **kw)
        out = np.asarray(out.astype(jnp.float32))
        ref = np.asarray(ref.astype(jnp.float32))
        finite = bool(np.isfinite(out).all()) and bool(np.isfinite(ref).all())
        err = float(np.max(np.abs(out - ref)))
        pad_zero = bool((out[p["rows"]:] == 0).all())
        tol = 2e-2 if dt == jnp.bfloat16 else 1e-4
        good = finite and err <= tol and pad_zero
        ok &= good
        cfg = block_config(p["q"].shape[0], p["page_table"].shape[0], p["page_table"].shape[1],
                           ps, hq, hkv, d, dt, **knobs)
        log(f"  {'PASS' if good else 'FAIL'} {name:34s} max_abs_err={err:.2e} tol={tol:.0e} "
            f"finite={finite} pad_zero={pad_zero} bm={cfg.block_m} bn={cfg.block_n} "
            f"splits={cfg.num_splits}")
    return ok


# --------------------------------------------------------------------------- timing


class Pool:
    """One shared, random K/V page pool, sized for the largest cell."""

    def __init__(self, num_pages, page_size, key):
        shape = (num_pages, page_size, HKV, D)
        chunk = max(1, (1 << 30) // (page_size * HKV * D))  # ~1G elements per chunk
        ks, vs = [], []
        for i, s in enumerate(range(0, num_pages, chunk)):
            n = min(chunk, num_pages - s)
            ka, kb = jax.random.split(jax.random.fold_in(key, i))
            ks.append(jax.random.normal(ka, (n, *shape[1:]), jnp.bfloat16))
            vs.append(jax.random.normal(kb, (n, *shape[1:]), jnp.bfloat16))
        self.k = jnp.concatenate(ks) if len(ks) > 1 else ks[0]
        del ks
        self.v = jnp.concatenate(vs) if len(vs) > 1 else vs[0]
        del vs
        self.k.block_until_ready()
        self.v.block_until_ready()
        self.num_pages = num_pages
        self.page_size = page_size


def cell_inputs(pool, rng, batch, ctx, q_len):
    ps = pool.page_size
    P = -(-ctx // ps)
    pages = rng.choice(np.arange(1, pool.num_pages), size=batch * P, replace=False)
    table = jnp.asarray(pages.reshape(batch, P).astype(np.int32))
    T = batch * q_len
    q = jax.random.normal(jax.random.PRNGKey(batch * 7919 + ctx + q_len), (T, HQ, D), jnp.bfloat16)
    cu = jnp.asarray(np.arange(batch + 1, dtype=np.int32) * q_len)
    kvl = jnp.full((batch,), ctx, jnp.int32)
    return q, table, cu, kvl


def time_chain(fn, q, rest, n, reps):
    """Median seconds per call of fn chained n times inside one executable."""

    @jax.jit
    def chain(q0, *r):
        x = q0
        for _ in range(n):
            x = fn(x, *r)
        return x

    chain(q, *rest).block_until_ready()  # compile + warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        chain(q, *rest).block_until_ready()
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts)


def measure_copy_bw():
    n = (1 << 30) if not INTERPRET else (1 << 20)  # 4 GiB of fp32
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001 + 0.5)
    f(x).block_until_ready()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        y = x
        for _ in range(5):
            y = f(y)
        y.block_until_ready()
        ts.append((time.perf_counter() - t0) / 5)
    t = statistics.median(ts)
    del x, y
    return 2 * n * 4 / t  # bytes read + written per second


def kernel_fn(knobs):
    def fn(q, k, v, kvl, table, cu, ns):
        return ragged_paged_attention(q, k, v, kvl, table, cu, ns,
                                      sm_scale=1.0 / math.sqrt(D), interpret=INTERPRET, **knobs)
    return fn


def ref_fn(q, k, v, kvl, table, cu, ns):
    return ragged_paged_attention_reference(q, k, v, kvl, table, cu, ns,
                                            sm_scale=1.0 / math.sqrt(D))


def ref_cost(batch, ctx, q_len):
    """(bytes of temporaries, bytes touched) the reference's chosen evaluation order needs."""
    T, S, K = batch * q_len, batch, ctx
    per_row = T * K * (HKV * D + HQ)
    per_seq = S * K * HKV * D + T * HQ * S * K
    elems = min(per_row, per_seq)
    return elems * 4 * 3, elems * 4 * 4


def kv_bytes(batch, ctx, q_len):
    return batch * ctx * HKV * D * 2 * 2 + 2 * batch * q_len * HQ * D * 2


def n_iters(est_s):
    return int(min(48, max(6, math.ceil(4e-3 / max(est_s, 1e-7)))))


def time_kv_write(rng, page_size):
    """XLA scatter of T new tokens into a donated stacked [L, N, ps, Hkv, D] cache."""
    from pallas_kernels.ragged_paged_attention.reference import write_kv_pages_reference

    L, N, n = 8, 8192, 16
    k = jax.random.normal(jax.random.PRNGKey(3), (L, N, page_size, HKV, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(4), (L, N, page_size, HKV, D), jnp.bfloat16)
    res = {}
    for T in (32, 256, 2048):
        nk = jax.random.normal(jax.random.PRNGKey(T), (T, HKV, D), jnp.bfloat16)
        nv = nk * 0.5
        slots = jnp.asarray(rng.choice(np.arange(page_size, N * page_size), T, replace=False)
                            .astype(np.int32))

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def chain(k, v, nk, nv, slots):
            for i in range(n):
                k, v = write_kv_pages_reference(k, v, nk, nv, slots, layer=jnp.int32(i % L))
            return k, v

        k, v = chain(k, v, nk, nv, slots)
        k.block_until_ready()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            k, v = chain(k, v, nk, nv, slots)
            k.block_until_ready()
            ts.append((time.perf_counter() - t0) / n)
        res[T] = statistics.median(ts) * 1e6
    log("kv write (XLA scatter, donated, stacked cache): "
        + ", ".join(f"T={T}: {t:.1f} us" for T, t in res.items()))
    return res


# --------------------------------------------------------------------------- tune


def run_tune(pool, rng, bw, args):
    log("== tune: block_n / num_warps / num_stages (automatic splits), then split waves")
    cells = [(32, 8192, 1), (128, 4096, 1), (4, 32768, 1), (32, 8192, 8), (128, 4096, 8)]
    tiles = [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 3),
             (128, 8, 2), (128, 8, 3)]
    if INTERPRET:
        cells, tiles = [(2, 256, 1), (2, 256, 8)], [(32, 4, 3), (64, 4, 3)]
    if args.tune_cells:
        cells = [tuple(int(x) for x in c.split(",")) for c in args.tune_cells.split(";")]
    if args.tune_tiles:
        tiles = [tuple(int(x) for x in c.split(",")) for c in args.tune_tiles.split(";")]
    res = {}
    for b, c, ql in cells:
        q, table, cu, kvl = cell_inputs(pool, rng, b, c, ql)
        est = kv_bytes(b, c, ql) / bw
        for bn, nw, st in tiles:
            knobs = dict(block_n=bn, num_warps=nw, num_stages=st)
            try:
                t = time_chain(kernel_fn(knobs), q, (pool.k, pool.v, kvl, table, cu,
                                                     jnp.int32(b)), n_iters(est), 3)
            except Exception as e:  # a config Triton rejects
                log(f"  cell b{b} ctx{c} q{ql} {knobs}: FAILED {type(e).__name__}: "
                    f"{str(e)[:200]}")
                t = float("inf")
            res[(b, c, ql, bn, nw, st)] = t
        row = " ".join(f"{res[(b, c, ql, *tl)] * 1e6:8.1f}" for tl in tiles)
        log(f"  b{b:<4d} ctx{c:<6d} q{ql}: floor {est * 1e6:7.1f} us | {row}")
    log("  columns: " + " ".join(f"bn{bn}/w{nw}/s{st}" for bn, nw, st in tiles))

    def best_for(qls):
        def score(tl):
            vals = [res[(b, c, ql, *tl)] for b, c, ql in cells if ql in qls]
            return math.exp(sum(math.log(v) for v in vals) / len(vals))
        return min(tiles, key=score)

    qls = {c[2] for c in cells}
    best = {"decode": best_for({1}) if 1 in qls else tiles[0],
            "verify": best_for({4, 8}) if qls & {4, 8} else tiles[0]}
    log(f"  best tiles: decode {best['decode']}  verify {best['verify']}")
    if args.no_waves:
        return best, args.waves, {"tiles": {f"b{b}_ctx{c}_q{ql}_bn{bn}_w{nw}_s{st}": t
                                            for (b, c, ql, bn, nw, st), t in res.items()}}

    # Split heuristic: waves of programs targeted before splitting the KV range.
    split_cells = [(1, 32768, 1), (4, 8192, 1), (16, 8192, 1), (32, 8192, 1), (32, 8192, 8)]
    if INTERPRET:
        split_cells = [(1, 512, 1)]
    waves_opts = [1.0, 2.0, 4.0, 8.0]
    wres = {}
    for b, c, ql in split_cells:
        q, table, cu, kvl = cell_inputs(pool, rng, b, c, ql)
        bn, nw, st = best["decode" if ql == 1 else "verify"]
        est = kv_bytes(b, c, ql) / bw
        row = []
        for w in waves_opts + [0.0]:
            cfg = block_config(b * ql, b, table.shape[1], pool.page_size, HQ, HKV, D,
                               jnp.bfloat16, block_n=bn, split_target_waves=w or 1.0,
                               num_splits=1 if w == 0.0 else None)
            knobs = dict(block_n=bn, num_warps=nw, num_stages=st, num_splits=cfg.num_splits)
            t = time_chain(kernel_fn(knobs), q, (pool.k, pool.v, kvl, table, cu, jnp.int32(b)),
                           n_iters(est), 3)
            wres[(b, c, ql, w)] = t
            row.append(f"{t * 1e6:8.1f}(ns{cfg.num_splits})")
        log(f"  b{b:<4d} ctx{c:<6d} q{ql}: floor {est * 1e6:7.1f} us | " + " ".join(row))
    log("  columns: waves " + " ".join(str(w) for w in waves_opts) + " | no split")

    def wscore(w):
        vals = [wres[(b, c, ql, w)] for b, c, ql in split_cells]
        return math.exp(sum(math.log(v) for v in vals) / len(vals))

    best_w = min(waves_opts, key=wscore)
    log(f"  best split waves: {best_w}")
    tune_log = {
        "tiles": {f"b{b}_ctx{c}_q{ql}_bn{bn}_w{nw}_s{st}": t
                  for (b, c, ql, bn, nw, st), t in res.items()},
        "waves": {f"b{b}_ctx{c}_q{ql}_waves{w}": t for (b, c, ql, w), t in wres.items()},
        "best": {"decode": best["decode"], "verify": best["verify"], "split_waves": best_w},
    }
    return best, best_w, tune_log


# --------------------------------------------------------------------------- bench


def run_bench(pool, rng, bw, args, best, best_w):
    # Longest contexts first: if the deadline cuts the run short, the short-context cells go.
    cells = [(b, c, ql) for c in sorted(args.contexts, reverse=True) for b in args.batches
             for ql in args.qlens]
    cells = [x for x in cells if x[0] * x[1] <= pool.num_pages * pool.page_size - pool.page_size]
    rows = []
    t_start = time.time()
    for b, c, ql in tqdm(cells, desc="bench", mininterval=5, file=sys.stdout):
        if time.time() > args.deadline_at:
            log(f"deadline reached: skipping cell b{b} ctx{c} q{ql} and the rest")
            break
        q, table, cu, kvl = cell_inputs(pool, rng, b, c, ql)
        rest = (pool.k, pool.v, kvl, table, cu, jnp.int32(b))
        if best is None:  # the kernel's own defaults
            knobs = {}
            cfg = block_config(b * ql, b, table.shape[1], pool.page_size, HQ, HKV, D,
                               jnp.bfloat16)
            bn, nw, st = cfg.block_n, cfg.num_warps, cfg.num_stages
        else:
            bn, nw, st = best["decode" if ql == 1 else "verify"]
            cfg = block_config(b * ql, b, table.shape[1], pool.page_size, HQ, HKV, D,
                               jnp.bfloat16, block_n=bn, num_warps=nw, num_stages=st,
                               split_target_waves=best_w)
            knobs = dict(block_n=bn, num_warps=nw, num_stages=st, num_splits=cfg.num_splits)
        nbytes = kv_bytes(b, c, ql)
        floor = nbytes / bw
        t_k = time_chain(kernel_fn(knobs), q, rest, n_iters(floor), 5)
        row = dict(batch=b, context=c, q_len=ql, tokens=b * ql, kv_bytes=nbytes,
                   floor_us=floor * 1e6, kernel_us=t_k * 1e6, pct_bw=100 * floor / t_k,
                   kernel_tb_s=nbytes / t_k / 1e12, block_m=cfg.block_m, block_n=bn,
                   num_warps=nw, num_stages=st, num_splits=cfg.num_splits)
        tmp, touched = ref_cost(b, c, ql)
        elapsed = time.time() - t_start
        if tmp > args.ref_max_bytes:
            row["ref_us"] = None
            row["ref_skip"] = f"needs ~{tmp / 2**30:.0f} GiB of temporaries"
        elif elapsed > args.ref_time_budget:
            row["ref_us"] = None
            row["ref_skip"] = "time budget"
        else:
            try:
                est_ref = touched / (0.5 * bw)
                t_r = time_chain(ref_fn, q, rest, max(2, min(10, n_iters(est_ref) // 3)), 3)
                row["ref_us"] = t_r * 1e6
                row["speedup_vs_ref"] = t_r / t_k
                out_k = kernel_fn(knobs)(q, *rest).astype(jnp.float32)
                out_r = ref_fn(q, *rest).astype(jnp.float32)
                row["max_abs_err_vs_ref"] = float(jnp.max(jnp.abs(out_k - out_r)))
            except Exception as e:  # OOM or similar
                row["ref_us"] = None
                row["ref_skip"] = f"{type(e).__name__}"
        rows.append(row)
    # verify / decode ratios
    dec = {(r["batch"], r["context"]): r["kernel_us"] for r in rows if r["q_len"] == 1}
    for r in rows:
        base = dec.get((r["batch"], r["context"]))
        r["ratio_vs_decode"] = r["kernel_us"] / base if base else None
    return rows


def write_results(out_dir, meta, rows, tune_log, check_ok):
    os.makedirs(out_dir, exist_ok=True)
    rows = sorted(rows, key=lambda r: (r["context"], r["batch"], r["q_len"]))
    with open(os.path.join(out_dir, "ragged_paged_attention_h200.json"), "w") as f:
        json.dump({**meta, "check_passed": check_ok, "tune": tune_log, "cells": rows}, f,
                  indent=1)
    lines = [
        "# Ragged paged attention on the H200",
        "",
        f"- device: {meta['device']}; jax {meta['jax_version']}; date {meta['date']}; "
        f"git commit {meta['git_commit']}",
        f"- heads: Hq {HQ}, Hkv {HKV}, head_dim {D}, bf16; page size {meta['page_size']}; "
        f"every sequence at the same context; kv_len includes the q_len new tokens",
        f"- measured device copy bandwidth (read + write): {meta['copy_bw_tb_s']:.2f} TB/s; "
        "HBM floor = (K/V bytes + q/out bytes) / that bandwidth",
        "- times: median per call of a chain of calls inside one jit (output feeds the next "
        "q); cells under ~60 MB of K/V sit in the 60 MB L2, so % of bandwidth can pass 100",
        f"- tiles (block_n, num_warps, num_stages): {meta['best']}; per-cell block_m, "
        "block_n and splits are in the JSON",
        f"- KV write path (XLA scatter into the donated stacked cache), us per call: "
        f"{meta.get('kv_write_us')}",
        f"- GPU correctness check passed: {check_ok}",
        "",
        "| batch | context | q_len | splits | kernel us | floor us | % of BW | TB/s | "
        "verify/decode | XLA ref us | kernel speedup | max err vs ref |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ref = f"{r['ref_us']:.1f}" if r.get("ref_us") else f"skip ({r.get('ref_skip')})"
        sp = f"{r['speedup_vs_ref']:.1f}x" if r.get("speedup_vs_ref") else "-"
        err = f"{r['max_abs_err_vs_ref']:.1e}" if r.get("max_abs_err_vs_ref") is not None else "-"
        ratio = f"{r['ratio_vs_decode']:.2f}" if r.get("ratio_vs_decode") else "-"
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['q_len']} | {r['num_splits']} | "
            f"{r['kernel_us']:.1f} | {r['floor_us']:.1f} | {r['pct_bw']:.0f}% | "
            f"{r['kernel_tb_s']:.2f} | {ratio} | {ref} | {sp} | {err} |")
    goal = [r for r in rows if r["batch"] >= 32 and r["context"] >= 4096]
    if goal:
        lines += [
            "",
            "## Goals",
            "",
            f"- % of bandwidth at batch >= 32 and context >= 4k: min "
            f"{min(r['pct_bw'] for r in goal):.0f}%, median "
            f"{statistics.median(r['pct_bw'] for r in goal):.0f}% (goal >= 70%)",
        ]
        v8 = [r["ratio_vs_decode"] for r in rows if r["q_len"] == 8 and r["ratio_vs_decode"]]
        if v8:
            lines.append(f"- verify q_len 8 / decode at the same context: max {max(v8):.2f}, "
                         f"median {statistics.median(v8):.2f} (goal <= 1.3)")
        v8g = [r["ratio_vs_decode"] for r in goal if r["q_len"] == 8]
        if v8g:
            lines.append(f"- same, batch >= 32 and context >= 4k: max {max(v8g):.2f}")
        sp = [r["speedup_vs_ref"] for r in rows if r.get("speedup_vs_ref")]
        if sp:
            lines.append(f"- speedup over the XLA reference where it ran: min {min(sp):.1f}x, "
                         f"median {statistics.median(sp):.1f}x")
    with open(os.path.join(out_dir, "ragged_paged_attention_h200.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n".join(lines))


# --------------------------------------------------------------------------- ratio mode
#
# Verify (q_len 4 / 8) against decode (q_len 1) at the same context, batch <= 16, on a page
# pool large enough that every K/V array passes 4 GiB (the Pallas Triton lowering switches to
# int64 offsets there), for several kernel "arms".  An arm is a policy: the knobs used for
# decode and the knobs used for verify (kernel.py: ADDRESSING / PROLOGUES / PAGE_LOOKUPS and
# the tile parameters).  ``split_target_waves`` goes to block_config; everything else is passed
# to the kernel explicitly, so the launch geometry of every timing is recorded in the JSON.

RATIO_ARMS = {
    "base": (
        {}, {},
        "kernel defaults (block_config): decode bn128/w4/s3; verify w4/s3, and for <= 8 sequences "
        "bn64 with carried page ids"),
    "prev_default": (
        {}, {"num_warps": 8, "num_stages": 2, "page_lookup": "inline", "block_n": 128},
        "the verify default before 2026-12-01: bn128/w8/s2, inline page ids"),
    "w4s3": (
        {}, {"num_warps": 4, "num_stages": 3, "page_lookup": "inline", "block_n": 128},
        "verify with the decode tile parameters (bn128, 4 warps, 3 stages, inline page ids)"),
    "flat_vec": (
        {"addressing": "flat", "prologue": "vector"},
        {"addressing": "flat", "prologue": "vector", "num_warps": 4, "num_stages": 3, "page_lookup": "inline",
         "block_n": 128},
        "int32 row addressing of a [rows, D] view + vector prologue; verify w4/s3"),
    "carry": (
        {"page_lookup": "carry", "num_warps": 4, "num_stages": 2},
        {"page_lookup": "carry", "num_warps": 8, "num_stages": 2, "block_n": 128},
        "page ids of tile j+1 loaded in iteration j; decode w4/s2, verify w8/s2"),
    "carry_s3": (
        {"page_lookup": "carry", "num_warps": 4, "num_stages": 3},
        {"page_lookup": "carry", "num_warps": 8, "num_stages": 3, "block_n": 128},
        "carried page ids + 3 stages (two K/V tiles in flight per program)"),
    "carry_bn64": (
        {"page_lookup": "carry", "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"page_lookup": "carry", "block_n": 64, "num_warps": 4, "num_stages": 3},
        "carried page ids, 64-token KV tiles, w4/s3 for both"),
    "carry_bn64_s4": (
        {"page_lookup": "carry", "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"page_lookup": "carry", "block_n": 64, "num_warps": 4, "num_stages": 4},
        "as carry_bn64, verify with 4 stages (three 64-token K/V tiles buffered)"),
    "bq4": (
        {}, {"block_q": 4, "num_warps": 4, "num_stages": 3, "page_lookup": "inline", "block_n": 128},
        "verify split into 16-row (4-token) q blocks with the decode tile; K/V read twice"),
    # A lone sequence's verify (S == 1, q_len <= 8) ran 16-row q tiles at any context from 13cadbb
    # until 47cac85 bounded the rule by the page table's span (fd45e86: short windows over <= 32 MiB
    # of K/V, kernel.block_config); before that,
    # at batch 1 and 16k / 32k it still cost 1.33 / 1.46x decode (4 waves of one-per-SM programs
    # against decode's 2).  64-token K/V tiles take half the shared memory: two programs per SM.
    "bm32_s1": (
        {}, {"block_q": 8},
        "32-row q tiles (8 tokens x 4 heads) at every context, small-batch knobs"),
    "bq4_bn64": (
        {}, {"block_q": 4, "block_n": 64, "num_warps": 4, "num_stages": 3, "page_lookup": "inline"},
        "16-row q tiles with 64-token K/V tiles (two resident programs per SM)"),
    "bq4_bn64_carry": (
        {}, {"block_q": 4, "block_n": 64, "num_warps": 4, "num_stages": 3, "page_lookup": "carry"},
        "as bq4_bn64, next tile's page ids loaded one iteration ahead"),
    # Clean single-knob variants of the lone-sequence 16-row tile (the defaults otherwise), for
    # the 16k / 32k cells where it still cost 1.32 / 1.34x decode at 9cab8e4 while the 32-row
    # tile cost 1.13 / 1.14x there but 1.47 / 1.41x at 2k / 8k.
    "s1_waves2": (
        {}, {"block_q": 4, "split_target_waves": 2.0},
        "16-row q tiles, KV split for 2 waves of programs instead of 4 (as many programs as decode)"),
    "s1_carry": (
        {}, {"block_q": 4, "page_lookup": "carry"},
        "16-row q tiles with the next 128-token tile's page ids loaded one iteration ahead"),
    "s1_tok2048": (
        {}, {"block_q": 4, "min_split_tokens": 2048},
        "16-row q tiles, splits of >= 2048 KV tokens (a quarter of the programs at 32k)"),
    "waves2": (
        {}, {"split_target_waves": 2.0, "num_warps": 8, "num_stages": 2, "page_lookup": "inline", "block_n": 128},
        "verify splits the KV range for 2 waves of programs instead of 4 (longer programs)"),
    # The flash-decoding split rule in latency-bound cells (batch <= 16, context <= 8k): the
    # defaults split both phases for 4 waves of programs, each split >= 512 KV tokens
    # (kernel.block_config); the arms below move one knob.
    "tok256": (
        {"min_split_tokens": 256}, {"min_split_tokens": 256},
        "defaults, splits of >= 256 KV tokens (twice as many splits where the floor binds)"),
    "tok1024": (
        {"min_split_tokens": 1024}, {"min_split_tokens": 1024},
        "defaults, splits of >= 1024 KV tokens (half as many splits where the floor binds)"),
    "waves1": (
        {"split_target_waves": 1.0}, {"split_target_waves": 1.0},
        "defaults, splits sized for one wave of programs instead of four"),
    "bn128_carry": (
        {}, {"page_lookup": "carry", "block_n": 128, "num_warps": 4, "num_stages": 3},
        "verify with 128-token KV tiles and carried page ids (w4/s3); decode defaults"),
    # Resident programs: 128-token K/V tiles at 3 stages take ~192 KB of shared memory (one
    # program per SM), 64-token tiles ~96 KB (two), so the split count that fills the GPU once
    # depends on the tile.
    "bn64_all": (
        {"block_n": 64, "num_warps": 4, "num_stages": 3}, {},
        "decode with 64-token KV tiles too (two programs per SM); verify defaults"),
    "v_bn128": (
        {}, {"page_lookup": "carry", "block_n": 128, "num_warps": 4, "num_stages": 3},
        "verify with 128-token KV tiles and carried page ids under the default split rule"),
    "tok128": (
        {"min_split_tokens": 128}, {"min_split_tokens": 128},
        "defaults, splits of >= 128 KV tokens"),
    "dec_waves1": (
        {"split_target_waves": 1.0}, {},
        "decode splits for one wave (one resident 128-token-tile program per SM); verify defaults"),
    # Short-context decode (the batch-1 decode benchmark's ~160 tokens: 8 programs, one per kv
    # head, two 128-token tiles each; ~6.5 us per layer in the step profile): shorter chains.
    "dec_bn64_tok64": (
        {"block_n": 64, "num_warps": 4, "num_stages": 3, "min_split_tokens": 64}, {},
        "decode with 64-token tiles and splits of >= 64 tokens (more, shorter programs); verify defaults"),
    "dec_bn256_s2": (
        {"block_n": 256, "num_warps": 4, "num_stages": 2}, {},
        "decode with 256-token tiles (one tile per program up to 256 tokens), 2 stages; verify defaults"),
    "dec_s2": (
        {"num_stages": 2}, {},
        "decode defaults with 2 stages instead of 3"),
    "combo": (
        {"addressing": "flat", "prologue": "vector", "page_lookup": "carry", "block_n": 64,
         "num_warps": 4, "num_stages": 3},
        {"addressing": "flat", "prologue": "vector", "page_lookup": "carry", "block_n": 64,
         "num_warps": 4, "num_stages": 3},
        "flat + vector + carry, 64-token tiles, w4/s3 for both"),
}
_CFG_KNOBS = ("block_q", "block_n", "num_warps", "num_stages", "addressing", "prologue",
              "page_lookup")


class NumericalMismatch(RuntimeError):
    pass


def arm_config(arm, q_len, batch, ctx, page_size):
    """(BlockConfig, explicit kernel kwargs) of one arm for one uniform cell."""
    dec, ver, _ = RATIO_ARMS[arm]
    knobs = dict(dec if q_len == 1 else ver)
    P = -(-ctx // page_size)
    # knobs an arm leaves out take block_config's defaults (so "base" is the kernel's own rule)
    cfg = block_config(batch * q_len, batch, P, page_size, HQ, HKV, D, jnp.bfloat16, **knobs)
    kw = {k: getattr(cfg, k) for k in _CFG_KNOBS}
    kw["num_splits"] = cfg.num_splits
    return cfg, kw


def _cfg_dict(cfg):
    return {k: getattr(cfg, k) for k in ("block_q", "block_m", "block_n", "num_warps",
                                         "num_stages", "num_splits", "addressing", "prologue",
                                         "page_lookup")}


def _compare(name, out, want, tol, pad_from=None):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    finite = bool(np.isfinite(out).all())
    err = float(np.max(np.abs(out - want))) if finite else float("inf")
    pad_ok = True if pad_from is None else bool((out[pad_from:] == 0).all())
    if not (finite and err <= tol and pad_ok):
        raise NumericalMismatch(f"{name}: finite={finite} max_abs_err={err:.3e} (tol {tol:.0e}) "
                                f"pad_rows_zero={pad_ok}")
    return err


def ratio_check(pool, rng, arms, poison_page):
    """Every arm's decode and verify knobs vs the reference on a ragged batch drawn from the
    large pool (pages in its upper half, so offsets pass 2**32 bytes), causal and non-causal,
    unsplit and split; unused page-table entries point at a NaN page, padding q rows are NaN."""
    log("== ratio check: arms vs reference on the large pool (causal and causal=False)")
    ps = pool.page_size
    q_lens = [1, 8, 4, 8, 1, 19, 8, 2]
    kv_lens = [int(q) + int(rng.integers(0, 700)) for q in q_lens]
    kv_lens[0], kv_lens[3] = 1, 8
    if INTERPRET:
        q_lens, kv_lens = [1, 8, 4, 3], [1, 40, 300, 9]  # 300: several KV tiles
    ns = len(q_lens)
    need = pages_needed(kv_lens, ps)
    lo = pool.num_pages // 2
    pages = rng.choice(np.arange(lo, poison_page), size=sum(need), replace=False)
    table, cu, kvl = ragged_metadata(q_lens, kv_lens, pages, num_slots=ns + 2, pages_per_seq=max(need) + 2,
                                     page_size=ps, fill_page=poison_page)
    rows = int(cu[ns])
    T = rows + 5
    q = np.asarray(rng.standard_normal((T, HQ, D)), np.float32)
    q[rows:] = np.nan
    args = (jnp.asarray(q, jnp.bfloat16), pool.k, pool.v, jnp.asarray(kvl), jnp.asarray(table),
            jnp.asarray(cu), jnp.int32(ns))
    scale = 1.0 / math.sqrt(D)
    ref_fn = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "causal"))
    with jax.default_matmul_precision("highest"):
        refs = {c: ref_fn(*args, sm_scale=scale, causal=c) for c in (True, False)}
    jobs = {}
    for arm in arms:
        dec, ver, _ = RATIO_ARMS[arm]
        for role, knobs in (("decode", dec), ("verify", ver)):
            knobs = {k: v for k, v in knobs.items() if k != "split_target_waves"}
            for causal, splits in ((True, None), (True, 1), (False, 4)):
                kw = dict(knobs, causal=causal)
                if splits:
                    kw["num_splits"] = splits
                key = tuple(sorted(kw.items()))
                if key not in jobs:
                    jobs[key] = (f"{arm}/{role} causal={causal} splits={splits or 'auto'}", kw)

    def compile_one(kw):
        try:
            f = functools.partial(ragged_paged_attention, sm_scale=scale, interpret=INTERPRET,
                                  **kw)
            return jax.jit(f).lower(*args).compile()
        except Exception as e:  # a configuration Triton rejects: not a wrong result
            return e

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max(1, min(12, os.cpu_count() or 2))) as ex:
        exes = list(ex.map(compile_one, [kw for _, kw in jobs.values()]))
    res = {}
    for (name, kw), exe in zip(jobs.values(), exes):
        if isinstance(exe, Exception):
            log(f"  COMPILE-FAIL {name}: {type(exe).__name__}: {str(exe)[:300]}")
            res[name] = f"compile failed: {type(exe).__name__}"
            continue
        err = _compare(name, exe(*args), refs[kw["causal"]], 2e-2, pad_from=rows)
        res[name] = err
        log(f"  PASS {name:55s} max_abs_err={err:.2e}")
    return res


def _ratio_cells(args):
    order_b = [b for b in (4, 16, 1, 8) if b in args.ratio_batches]
    order_b += [b for b in args.ratio_batches if b not in order_b]
    order_c = [c for c in (8192, 32768, 2048) if c in args.ratio_contexts]
    order_c += [c for c in args.ratio_contexts if c not in order_c]
    return [(b, c) for c in order_c for b in order_b]


def _ratio_inputs(pool, rng, batch, ctx, poison_page):
    ps = pool.page_size
    P = -(-ctx // ps)
    pages = rng.choice(np.arange(1, poison_page), size=batch * P, replace=False)
    table = jnp.asarray(pages.reshape(batch, P).astype(np.int32))
    kvl = jnp.full((batch,), ctx, jnp.int32)
    return table, kvl


def _build_chain(kw, n):
    fn = kernel_fn(kw)

    def chain(q0, *r):
        x1 = fn(q0, *r)
        x = x1
        for _ in range(n - 1):
            x = fn(x, *r)
        return x1, x

    return chain


def run_ratio(args):
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.time()
    deadline = t0 + args.deadline
    dev = jax.devices()[0]
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
        f"{getattr(dev, 'core_count', '?')} SMs; ratio mode")
    arms = [a.strip() for a in args.arms.split(",")] if args.arms else list(RATIO_ARMS)
    bad = [a for a in arms if a not in RATIO_ARMS]
    if bad:
        raise SystemExit(f"unknown arms {bad}; known: {list(RATIO_ARMS)}")
    if "base" not in arms:
        arms = ["base"] + arms
    rng = np.random.default_rng(0)
    bw = measure_copy_bw()
    log(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")
    ps = args.page_size
    page_bytes = 2 * ps * HKV * D * 2  # K + V
    cells = _ratio_cells(args)
    need = max(b * c for b, c in cells) // ps + 2
    # at least enough for the largest cell, and for the check (upper half of the pool)
    num_pages = max(int(args.pool_gib * 2**30 // page_bytes), need + 2, 256)
    t1 = time.time()
    pool = Pool(num_pages, ps, jax.random.PRNGKey(1))
    poison_page = num_pages - 1  # NaN page: unused table entries of the check point at it
    nan_page = jax.jit(lambda a: a.at[poison_page].set(jnp.nan), donate_argnums=0)
    pool.k = nan_page(pool.k)
    pool.v = nan_page(pool.v)
    k_bytes = pool.k.nbytes
    log(f"page pool: {num_pages} pages, {2 * k_bytes / 2**30:.1f} GiB K+V "
        f"({'int64' if k_bytes > 2**32 else 'int32'} Pallas offsets), {time.time() - t1:.0f}s")
    if not INTERPRET:
        gpu_warmup()
    meta = dict(
        mode="ratio", device=dev.device_kind, jax_version=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=args.git_commit, copy_bw_tb_s=bw / 1e12, page_size=ps,
        heads=dict(q=HQ, kv=HKV, head_dim=D, dtype="bfloat16"),
        pool=dict(pages=num_pages, kv_gib=2 * k_bytes / 2**30,
                  offsets="int64" if k_bytes > 2**32 else "int32"),
        arms={a: dict(decode=RATIO_ARMS[a][0], verify=RATIO_ARMS[a][1],
                      what=RATIO_ARMS[a][2]) for a in arms},
        timing=f"median over {args.reps} repetitions, interleaved across each cell's configurations, "
               f"of (chain of n calls in one jit) / n",
        interpret=INTERPRET,
    )
    rows, check = [], {}
    status = "complete"
    try:
        check = ratio_check(pool, rng, arms, poison_page)
        log(f"ratio check done ({time.time() - t0:.0f}s)")
        workers = max(1, min(12, (os.cpu_count() or 2)))
        for b, c in cells:
            if time.time() > deadline:
                status = f"deadline: stopped before b{b} ctx{c}"
                log(status)
                break
            table, kvl = _ratio_inputs(pool, rng, b, c, poison_page)
            rest = (pool.k, pool.v, kvl, table)
            jobs = {}  # (q_len, cfg) -> (kw, [arms])
            for ql in args.ratio_qlens:
                for arm in arms:
                    cfg, kw = arm_config(arm, ql, b, c, ps)
                    jobs.setdefault((ql, cfg), (kw, []))[1].append(arm)
            q_in = {ql: jax.random.normal(jax.random.PRNGKey(b * 7919 + c + ql),
                                          (b * ql, HQ, D), jnp.bfloat16)
                    for ql in args.ratio_qlens}
            cu = {ql: jnp.asarray(np.arange(b + 1, dtype=np.int32) * ql)
                  for ql in args.ratio_qlens}
            n = 1 if INTERPRET else n_iters(kv_bytes(b, c, 1) / bw)

            def compile_one(item):
                (ql, _), (kw, _) = item
                try:
                    return jax.jit(_build_chain(kw, n)).lower(
                        q_in[ql], *rest, cu[ql], jnp.int32(b)).compile()
                except Exception as e:  # a configuration Triton rejects
                    return e

            tc = time.time()
            with ThreadPoolExecutor(workers) as ex:
                exes = list(ex.map(compile_one, jobs.items()))
            tc = time.time() - tc
            base_x1 = {}
            timed = []  # (row, executable, args, times) of the configurations that checked out
            # base first (per q_len), so every other arm is compared against it
            items = sorted(zip(jobs.items(), exes), key=lambda it: "base" not in it[0][1][1])
            for ((ql, cfg), (kw, arm_names)), exe in items:
                row = dict(batch=b, context=c, q_len=ql, arms=arm_names, config=_cfg_dict(cfg),
                           kv_bytes=kv_bytes(b, c, ql),
                           floor_us=kv_bytes(b, c, ql) / bw * 1e6, chain=n)
                if isinstance(exe, Exception):
                    row["error"] = f"{type(exe).__name__}: {str(exe)[:300]}"
                    log(f"  COMPILE-FAIL b{b} ctx{c} q{ql} {arm_names}: {row['error']}")
                    rows.append(row)
                    continue
                call_args = (q_in[ql], *rest, cu[ql], jnp.int32(b))
                x1, _ = exe(*call_args)  # warm-up; x1 is one plain call's output
                x1.block_until_ready()
                label = f"b{b} ctx{c} q{ql} {'/'.join(arm_names)}"
                if "base" in arm_names:
                    base_x1[ql] = x1
                    tmp, _ = ref_cost(b, c, ql)
                    if tmp <= args.ratio_ref_max_bytes:
                        with jax.default_matmul_precision("highest"):
                            ref = jax.jit(ref_fn)(*call_args)
                        row["err_vs_ref"] = _compare(f"{label} vs reference", x1, ref, 2e-2)
                elif ql in base_x1:
                    row["err_vs_base"] = _compare(f"{label} vs base", x1, base_x1[ql], 2e-2)
                else:  # nothing to check it against: do not time it
                    row["error"] = "base arm failed to compile: result unchecked, not timed"
                    rows.append(row)
                    continue
                timed.append((row, exe, call_args, []))
            # Repetitions interleaved across the cell's configurations (round robin), so a drift of
            # the machine during the cell (clocks, other tenants) lands on every arm alike instead
            # of on whichever arm ran then: single cells of 15-60 us moved by up to 30% between
            # runs when each configuration was timed in one block.
            for _ in range(args.reps):
                for row, exe, call_args, ts in timed:
                    t_s = time.perf_counter()
                    out = exe(*call_args)
                    out[1].block_until_ready()
                    ts.append((time.perf_counter() - t_s) / n)
            for row, _, _, ts in timed:
                t = statistics.median(ts)
                row.update(us=t * 1e6, pct_bw=100 * row["floor_us"] / (t * 1e6))
                rows.append(row)
            got = {(r["q_len"], a): r.get("us") for r in rows
                   if r["batch"] == b and r["context"] == c for a in r["arms"]}
            log(f"  b{b:<3d} ctx{c:<6d} compile {tc:4.1f}s | " + " ".join(
                f"{a}:" + "/".join(f"{got.get((ql, a)) or float('nan'):.0f}"
                                   for ql in args.ratio_qlens) for a in arms)
                + f"  (us for q_len {'/'.join(map(str, args.ratio_qlens))})")
    except NumericalMismatch as e:
        status = f"NUMERICAL MISMATCH: {e}"
        log("!" * 80 + f"\n{status}\n" + "!" * 80)
    meta["status"] = status
    meta["total_s"] = time.time() - t0
    write_ratio_results(args.ratio_out, meta, check, rows, arms, args.ratio_qlens)
    log(f"total {time.time() - t0:.0f}s; status: {status}")
    if status.startswith("NUMERICAL"):
        sys.exit(2)


def _ratio_table(rows, arms):
    """{(batch, ctx): {arm: {q_len: us}}} plus the config of every timing."""
    tab = {}
    for r in rows:
        if r.get("us") is None:
            continue
        for a in r["arms"]:
            tab.setdefault((r["batch"], r["context"]), {}).setdefault(a, {})[r["q_len"]] = r["us"]
    return tab


def write_ratio_results(prefix, meta, check, rows, arms, qlens):
    d = os.path.dirname(prefix)
    if d:
        os.makedirs(d, exist_ok=True)
    tab = _ratio_table(rows, arms)
    summary = {}
    for a in arms:
        for ql in [q for q in qlens if q > 1]:
            own, vs_base = [], []
            for (b, c), per in tab.items():
                v = per.get(a, {}).get(ql)
                if v is None:
                    continue
                dec_base = tab[(b, c)].get("base", {}).get(1)
                dec_own = per.get(a, {}).get(1)
                if dec_base:
                    vs_base.append(v / dec_base)
                if dec_own:
                    own.append(v / dec_own)
            if vs_base:
                summary[f"{a}/q{ql}"] = dict(
                    max_vs_base_decode=max(vs_base),
                    geomean_vs_base_decode=math.exp(sum(map(math.log, vs_base)) / len(vs_base)),
                    max_vs_own_decode=max(own) if own else None,
                    cells=len(vs_base))
    with open(prefix + ".json", "w") as f:
        json.dump({**meta, "check": check, "summary": summary, "cells": rows}, f, indent=1)

    def cell(v):
        return "-" if v is None else f"{v:.1f}"

    lines = [
        "# Verify vs decode on the H200: kernel arms",
        "",
        f"- {meta['device']}; jax {meta['jax_version']}; {meta['date']}; commit "
        f"{meta['git_commit']}; status: **{meta['status']}**",
        f"- Hq {HQ}, Hkv {HKV}, D {D}, bf16, page size {meta['page_size']}; every sequence at "
        f"the context; pool {meta['pool']['kv_gib']:.1f} GiB K+V ({meta['pool']['offsets']} "
        f"offsets), pages drawn at random from all of it",
        f"- floor = (K/V + q/out bytes) / measured copy bandwidth "
        f"({meta['copy_bw_tb_s']:.2f} TB/s); {meta['timing']}",
        "- ratio = verify us / decode us at the same batch and context; 'vs base' divides by "
        "the base arm's decode, 'vs own' by the same arm's decode (what adopting the arm for "
        "both would give). Goal: q_len 8 <= 1.3x at batch <= 16.",
        "",
        "## Arms",
        "",
    ]
    for a in arms:
        lines.append(f"- **{a}**: {meta['arms'][a]['what']} (decode {meta['arms'][a]['decode']}, "
                     f"verify {meta['arms'][a]['verify']})")
    lines += ["", "## Summary (batch <= 16, all contexts measured)", "",
              "| arm | q_len | max ratio vs base decode | geomean vs base decode | "
              "max ratio vs own decode | cells |", "|---|---:|---:|---:|---:|---:|"]
    for k, s in summary.items():
        a, q = k.split("/q")
        own = f"{s['max_vs_own_decode']:.2f}" if s["max_vs_own_decode"] else "-"
        lines.append(f"| {a} | {q} | {s['max_vs_base_decode']:.2f} | "
                     f"{s['geomean_vs_base_decode']:.2f} | {own} | {s['cells']} |")
    keys = sorted(tab)
    for ql in qlens:
        lines += ["", f"## q_len {ql}: us per call" + ("" if ql == 1 else
                                                        " (ratio vs base decode)"), "",
                  "| batch | context | floor us | " + " | ".join(arms) + " |",
                  "|---:|---:|---:|" + "---:|" * len(arms)]
        for b, c in keys:
            per = tab[(b, c)]
            dec_base = per.get("base", {}).get(1)
            vals = []
            for a in arms:
                v = per.get(a, {}).get(ql)
                if v is None:
                    vals.append("-")
                elif ql == 1 or not dec_base:
                    vals.append(f"{v:.1f}")
                else:
                    vals.append(f"{v:.1f} ({v / dec_base:.2f})")
            floor = kv_bytes(b, c, ql) / (meta["copy_bw_tb_s"] * 1e12) * 1e6
            lines.append(f"| {b} | {c} | {floor:.1f} | " + " | ".join(vals) + " |")
    errs = [r for r in rows if r.get("error")]
    if errs:
        lines += ["", "## Configurations that failed to compile", ""]
        lines += [f"- b{r['batch']} ctx{r['context']} q{r['q_len']} {r['arms']}: {r['error']}"
                  for r in errs]
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--git-commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+",
                    default=[512, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--qlens", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--ref-max-bytes", type=float, default=24e9)
    ap.add_argument("--ref-time-budget", type=float, default=200.0,
                    help="seconds into the bench after which reference cells are skipped")
    ap.add_argument("--tiles", default=None,
                    help="skip tuning: 'bn,warps,stages' (decode and verify) and --waves")
    ap.add_argument("--tiles-verify", default=None, help="'bn,warps,stages' for q_len > 1")
    ap.add_argument("--waves", type=float, default=4.0)
    ap.add_argument("--tune-cells", default=None, help="'b,ctx,q;b,ctx,q;...' for --tune")
    ap.add_argument("--tune-tiles", default=None, help="'bn,w,s;bn,w,s;...' for --tune")
    ap.add_argument("--no-waves", action="store_true", help="--tune: skip the split sweep")
    ap.add_argument("--defaults", action="store_true",
                    help="bench with the kernel's automatic block sizes (no tuning)")
    ap.add_argument("--deadline", type=float, default=540.0,
                    help="seconds after start after which no new bench cell starts")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test (tiny shapes)")
    # ---- ratio mode: verify (q_len 4/8) vs decode per kernel arm, on a large page pool
    ap.add_argument("--ratio", action="store_true",
                    help="verify-vs-decode study of the kernel arms (RATIO_ARMS); runs alone")
    ap.add_argument("--ratio-out", default=None,
                    help="path prefix of the ratio results: writes PREFIX.json and PREFIX.md "
                         "(default <out>/ragged_paged_attention_h200_ratio)")
    ap.add_argument("--pool-gib", type=float, default=48.0,
                    help="ratio mode: K+V page pool size in GiB (> 8 puts each of K and V past "
                         "4 GiB, where Pallas switches to int64 offsets)")
    ap.add_argument("--ratio-batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--ratio-contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--ratio-qlens", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--arms", default=None,
                    help="ratio mode: comma-separated subset of RATIO_ARMS (base always runs)")
    ap.add_argument("--reps", type=int, default=5, help="ratio mode: timed repetitions")
    ap.add_argument("--ratio-ref-max-bytes", type=float, default=2e9,
                    help="ratio mode: check the base arm against the jnp reference in cells "
                         "whose reference temporaries stay under this")
    ap.add_argument("--ratio-deadline", type=float, default=165.0,
                    help="ratio mode: seconds after start after which no new cell starts")
    ap.add_argument("--smoke", action="store_true",
                    help="ratio mode on CPU in interpret mode with tiny sizes (implies --ratio)")
    args = ap.parse_args()
    global INTERPRET
    INTERPRET = args.interpret or args.smoke
    if args.smoke or args.ratio:
        if args.smoke:
            args.ratio_batches, args.ratio_contexts = [1, 2], [272]  # 3-5 KV tiles
            args.pool_gib, args.reps = 0.0, 1
            args.ratio_deadline = float("inf")  # the smoke test must reach every code path
        args.deadline = args.ratio_deadline
        if args.ratio_out is None:
            args.ratio_out = os.path.join(args.out, "ragged_paged_attention_h200_ratio")
        run_ratio(args)
        return
    if not (args.check or args.tune or args.bench):
        args.check = args.tune = args.bench = True

    t0 = time.time()
    args.deadline_at = t0 + args.deadline
    dev = jax.devices()[0]
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
        f"{getattr(dev, 'core_count', '?')} SMs")
    rng = np.random.default_rng(0)
    check_ok = None
    if args.check:
        check_ok = run_check(rng)
        log(f"check: {'PASS' if check_ok else 'FAIL'} ({time.time() - t0:.0f}s)")
        if not check_ok:
            sys.exit(1)
    if not (args.tune or args.bench):
        return

    bw = measure_copy_bw()
    log(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")
    max_tokens = max(b * c for b in args.batches for c in args.contexts)
    num_pages = max_tokens // args.page_size + 1
    t1 = time.time()
    pool = Pool(num_pages, args.page_size, jax.random.PRNGKey(1))
    log(f"page pool: {num_pages} pages, {2 * pool.k.nbytes / 2**30:.1f} GiB K+V, "
        f"{time.time() - t1:.0f}s")

    gpu_warmup()
    kv_write = time_kv_write(rng, args.page_size) if (args.bench and not INTERPRET) else None
    tune_log = {}
    if args.defaults:
        best, best_w = None, None
    elif args.tiles:
        tl = tuple(int(x) for x in args.tiles.split(","))
        tv = tuple(int(x) for x in args.tiles_verify.split(",")) if args.tiles_verify else tl
        best, best_w = {"decode": tl, "verify": tv}, args.waves
    elif args.tune:
        best, best_w, tune_log = run_tune(pool, rng, bw, args)
        log(f"tune done ({time.time() - t0:.0f}s)")
    else:
        best, best_w = {"decode": (64, 4, 3), "verify": (64, 4, 3)}, args.waves
    if not args.bench:
        return
    rows = run_bench(pool, rng, bw, args, best, best_w)
    meta = dict(
        device=dev.device_kind, jax_version=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=args.git_commit, copy_bw_tb_s=bw / 1e12, page_size=args.page_size,
        heads=dict(q=HQ, kv=HKV, head_dim=D, dtype="bfloat16"),
        best=("kernel defaults (block_config)" if best is None else
              dict(decode=best["decode"], verify=best["verify"], split_waves=best_w)),
        kv_write_us=kv_write,
        timing="median over 5 repetitions of (chain of n calls in one jit) / n",
    )
    write_results(args.out, meta, rows, tune_log, check_ok)
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
