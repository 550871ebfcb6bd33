"""Server start-up time, cold and warm: `python -m serving.launch` until /health answers 200.

Cold runs with an empty compilation cache (a fresh DSPARK_JAX_CACHE, so the cost table is
derived again too); warm runs again on the cache the cold run filled.  Each run sends one short
completion once healthy (its latency is reported beside) and is then stopped with SIGTERM.  The
server's own log (what it compiled, how long each took) is kept beside the results.

    python benchmarks/bench_startup.py --out-dir $OUT -- --model-path expand:qwen3-8b \\
        --max-running-requests 64 --max-model-len 4096
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, write_results  # noqa: E402
from benchmarks.server_process import http, launch, stop, wait_healthy  # noqa: E402


def start_once(server_args: list[str], cache_dir: Path, log_path: Path, timeout: float) -> dict:
    """Seconds from process start to a healthy /health, then one completion's latency."""
    t0 = time.perf_counter()
    proc, base = launch(server_args, log_path, env={"DSPARK_JAX_CACHE": str(cache_dir), "PYTHONUNBUFFERED": "1"})
    try:
        try:
            wait_healthy(proc, base, timeout - (time.perf_counter() - t0))
        except (RuntimeError, TimeoutError) as e:
            return {"error": str(e).splitlines()[0]}
        healthy = time.perf_counter() - t0
        t1 = time.perf_counter()
        status, _ = http(base + "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0},
                         timeout=120)
        return {"healthy_s": healthy, "first_request_s": time.perf_counter() - t1, "first_request_status": status}
    finally:
        stop(proc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-runs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    ap.add_argument("--cache-dir", type=Path, help="compilation cache to start from (default: a new empty one)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", action="append", default=[])
    ap.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: serving.launch arguments")
    args = ap.parse_args(argv)
    server_args = [a for a in args.server_args if a != "--"]
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="dspark-startup-"))
    logs = Path(args.out_dir[0]) / "logs" if args.out_dir else Path(tempfile.mkdtemp())
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(1 + args.warm_runs):
        kind = "cold" if i == 0 and args.cache_dir is None else "warm"
        res = start_once(server_args, cache, logs / f"startup{args.tag}_{i}_{kind}.log", args.timeout)
        runs.append({"run": i, "kind": kind, **res})
        print(runs[-1], flush=True)
    env = environment()
    payload = {"env": env, "server_args": server_args, "runs": runs}
    md = [f"# Server start-up ({env['device']}, jax {env['jax']}, {env['date']}, commit {env['commit']})\n",
          f"`python -m serving.launch {' '.join(server_args)}`; cold: an empty compilation cache; warm: the cache "
          "the cold run filled. healthy = process start to /health 200; first request = a 16-token completion "
          "right after.\n", "| run | cache | healthy s | first request s |", "|---:|---|---:|---:|"]
    for r in runs:
        md.append(f"| {r['run']} | {r['kind']} | {r.get('healthy_s', float('nan')):.1f} | "
                  f"{r.get('first_request_s', float('nan')):.2f} |" + (f" {r['error']}" if "error" in r else ""))
    write_results(f"startup_{env['platform']}{args.tag}", payload, "\n".join(md) + "\n", args.out_dir)
    print("\n".join(md))
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
