"""Device memory of an engine's compiled steps, from XLA's own buffer assignment.

For each selected executable: its arguments, outputs, how much of the outputs alias donated
arguments, and its temporaries, beside the KV caches' size, plus the largest buffers XLA
assigned in the optimized HLO.  A step that updates the donated caches in place needs
temporaries far below one cache; one that keeps a second copy of a cache shows it here.  A
step compiled for a large pool that needs more than the device's memory makes XLA spend minutes
rematerializing, which is what this is for.

    python benchmarks/step_memory.py --pair qwen3-8b --num-layers 8 --drafter-layers 3 \\
        --max-running-requests 64 --max-model-len 4096 --select "round tokens=8 " --out-dir $OUT
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import environment, write_results  # noqa: E402

GiB = 2**30
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "f64": 8}
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\][^ ]* ([\w\-]+)\(")


def large_buffers(hlo_text: str, min_bytes: int, limit: int = 20) -> list[dict]:
    """Array-valued instructions of the optimized HLO at least min_bytes large: (name, op, shape,
    GiB), largest first.  Aliased in-place updates show up too (their op says which)."""
    out = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m or m.group(2) not in _DTYPE_BYTES:
            continue
        dims = [int(d) for d in m.group(3).split(",") if d]
        size = int(np.prod(dims, dtype=np.int64)) * _DTYPE_BYTES[m.group(2)]
        if size >= min_bytes and m.group(4) not in ("parameter", "get-tuple-element", "bitcast"):
            out.append({"name": m.group(1), "op": m.group(4), "shape": f"{m.group(2)}[{m.group(3)}]",
                        "gib": round(size / GiB, 3)})
    return sorted(out, key=lambda r: -r["gib"])[:limit]


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="default", help="default, or a preset to expand to (qwen3-8b, ...)")
    ap.add_argument("--num-layers", type=int, help="target depth of the expansion (default: the preset's)")
    ap.add_argument("--drafter-layers", type=int, help="drafter depth of the expansion (default: the preset's)")
    ap.add_argument("--arm", default="compact+table", help="an arm of bench_speculative.py (compact+table: the "
                    "server's default, its table derived on the device)")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-pages", type=int, help="KV pages (default: sized by the engine)")
    ap.add_argument("--select", action="append", default=[],
                    help="substring of the executables' labels to compile (repeatable; default: all)")
    ap.add_argument("--compiler-option", action="append", default=[], metavar="KEY=VALUE",
                    help="XLA option for these compiles in place of the engine's own (repeatable; 'none': no "
                    "options, e.g. to see the rematerialization pass the engine turns off)")
    ap.add_argument("--hlo-dir", type=Path, help="write each selected executable's optimized HLO here")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args()

    from benchmarks.bench_speculative import Pair, build_engine, load_pair
    from dspark_jax.engine import EngineConfig

    t0 = time.perf_counter()
    if args.pair == "default":
        pair = load_pair("default", None)
    else:
        from dspark_jax.calibration.sts import StsCalibration
        from dspark_jax.expand import expand_pair

        p = expand_pair(shape=args.pair, progress=True, num_layers=args.num_layers,
                        drafter_layers=args.drafter_layers)
        pair = Pair(p.target, p.tokenizer, p.drafter, p.mtp, StsCalibration.load(p.sts_path))
    ec = EngineConfig(max_running_requests=args.max_running_requests, max_model_len=args.max_model_len,
                      num_pages=args.num_pages, precompile=False)
    engine = build_engine(args.arm, pair, ec, "derive")
    caches = {"target KV": tree_bytes(engine.runner.cache)}
    if hasattr(engine.worker, "dcache"):
        caches["draft KV"] = tree_bytes(engine.worker.dcache)
    weights = tree_bytes(engine.runner.state)
    stats = {k: v for k, v in (engine.parallel.device.memory_stats() or {}).items()
             if k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}
    print(f"engine ready in {time.perf_counter() - t0:.0f} s: weights {weights / GiB:.2f} GiB, "
          + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in caches.items())
          + "".join(f", {k} {v / GiB:.2f} GiB" for k, v in stats.items()), flush=True)

    rows, runner = [], engine.runner
    if args.compiler_option:
        runner.compiler_options = dict(o.split("=", 1) for o in args.compiler_option if o != "none")
    print(f"compiler options: {runner.compiler_options}", flush=True)
    for label, build in engine.executables():
        if args.select and not any(s in label + " " for s in args.select):
            continue
        captured = []
        compile_fn = runner.compile

        def capture(lowered, _compile=compile_fn, _out=captured):
            compiled = _compile(lowered)
            _out.append(compiled)
            return compiled

        runner.compile = capture
        t = time.perf_counter()
        try:
            build()
        finally:
            runner.compile = compile_fn
        seconds = time.perf_counter() - t
        for compiled in captured:
            m = compiled.memory_analysis()
            text = compiled.as_text()
            row = {"executable": label, "compile_s": round(seconds, 1),
                   "argument_gib": m.argument_size_in_bytes / GiB, "output_gib": m.output_size_in_bytes / GiB,
                   "alias_gib": m.alias_size_in_bytes / GiB, "temp_gib": m.temp_size_in_bytes / GiB,
                   "large_buffers": large_buffers(text, min_bytes=max(1, min(caches.values()) // 8))}
            rows.append(row)
            print(f"{label}: compile {seconds:.0f} s, args {row['argument_gib']:.2f} out {row['output_gib']:.2f} "
                  f"alias {row['alias_gib']:.2f} temp {row['temp_gib']:.2f} GiB", flush=True)
            for b in row["large_buffers"][:6]:
                print(f"    {b['gib']:8.3f} GiB  {b['op']:24s} {b['shape']}  {b['name']}", flush=True)
            if args.hlo_dir:
                args.hlo_dir.mkdir(parents=True, exist_ok=True)
                (args.hlo_dir / (re.sub(r"[^\w=.-]+", "_", label) + ".hlo.txt")).write_text(text)

    env = environment()
    payload = {"environment": env, "args": {k: str(v) for k, v in vars(args).items()},
               "compiler_options": runner.compiler_options, "weights_gib": weights / GiB, "caches_gib": {k: v / GiB for k, v in caches.items()},
               "device_memory_gib": {k: v / GiB for k, v in stats.items()},
               "executables": rows}
    md = [f"# Step memory, pair {args.pair}"
          f"{f' ({args.num_layers} target layers)' if args.num_layers else ''}, arm {args.arm} "
          f"({env['device']}, jax {env['jax']}, {env['date']}, commit {env['commit']})", "",
          f"XLA's memory analysis of each compiled step. Weights {weights / GiB:.2f} GiB; "
          + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in caches.items())
          + f". Compiler options {runner.compiler_options or 'none'}. alias = outputs written into donated "
          "arguments; temp = XLA's temporaries.", "",
          "| executable | compile s | arguments GiB | outputs GiB | aliased GiB | temporaries GiB | largest non-argument buffer |",
          "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        big = r["large_buffers"][0] if r["large_buffers"] else None
        md.append(f"| {r['executable']} | {r['compile_s']} | {r['argument_gib']:.2f} | {r['output_gib']:.2f} | "
                  f"{r['alias_gib']:.2f} | {r['temp_gib']:.2f} | "
                  + (f"{big['op']} {big['shape']} ({big['gib']:.2f} GiB)" if big else "-") + " |")
    write_results(f"step_memory_{args.pair}_{env['platform']}{args.tag}", payload, "\n".join(md) + "\n", args.out_dir)


if __name__ == "__main__":
    main()
