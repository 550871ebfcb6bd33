"""Shared benchmark plumbing: environment facts, bandwidth ceiling, random models, result files."""

from __future__ import annotations

import datetime as dt
import glob
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

RESULTS = Path(__file__).parent / "results"


def git_commit() -> str:
    """$GIT_COMMIT where the caller knows better (a copied tree whose .git is not its own), else
    HEAD, marked -dirty when the engine's sources differ from it."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, cwd=repo).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "serving", "dspark_jax", "pallas_kernels"],
                               cwd=repo).returncode
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    import flax

    d = jax.devices()[0]
    return {
        "device": getattr(d, "device_kind", str(d)),
        "platform": d.platform,
        "jax": jax.__version__,
        "flax": flax.__version__,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
    }


def time_fn(fn, *, warmup: int = 3, iters: int = 20) -> float:
    """Median seconds of fn() (which must block until its device work is done)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def time_chain(step, n: int, *, warmup: int = 2, reps: int = 5) -> float:
    """Median seconds per call of `step` over chains of n calls dispatched back to back.

    step() dispatches one call and returns something to block on; only the chain's last result
    is waited for, so the host's dispatch of call i+1 overlaps the device's work on call i (as in
    an overlapped serving loop) and the figure is device time per call unless the host is slower."""
    for _ in range(warmup):
        jax.block_until_ready(step())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n - 1):
            step()
        jax.block_until_ready(step())
        ts.append((time.perf_counter() - t0) / n)
    return float(np.median(ts))


def load_trace(trace_dir: str):
    """The jax.profiler trace written under trace_dir (its first .xplane.pb), as ProfileData."""
    from jax.profiler import ProfileData

    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
        raise RuntimeError(f"no trace written under {trace_dir}")
    return ProfileData.from_file(paths[0])


def device_kernel_events(trace_dir: str) -> list[tuple[str, float, float]]:
    """(name, start_ns, duration_ns) of every kernel on the first GPU's stream lines."""
    events = []
    for plane in load_trace(trace_dir).planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        for line in plane.lines:
            # Stream lines hold the kernels and memcpys; "XLA Ops" / "XLA Modules" lines repeat
            # the same time spans under HLO names and would double count.
            if not line.name.startswith("Stream"):
                continue
            events += [(e.name, float(e.start_ns), float(e.duration_ns)) for e in line.events]
    return sorted(events, key=lambda e: e[1])


def host_event_summary(trace_dir: str) -> list[dict]:
    """Host-thread events of a profiler trace, by (thread, name): count, inclusive and self
    microseconds (self = the event's span minus the spans of events directly nested in it on its
    thread), heaviest self time first.  Shows where a dispatch call's host time goes inside
    jaxlib (argument handling, buffer allocation, thunk execution, kernel launches)."""
    import collections

    totals = collections.defaultdict(lambda: [0, 0.0, 0.0])  # (thread, name) -> count, incl ns, self ns
    for plane in load_trace(trace_dir).planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            events = sorted(((float(e.start_ns), float(e.duration_ns), e.name) for e in line.events),
                            key=lambda e: (e[0], -e[1]))
            stack = []  # [end_ns, name, duration, nested duration]

            def close(entry, line_name=line.name):
                end, name, dur, nested = entry
                t = totals[line_name, name]
                t[0] += 1
                t[1] += dur
                t[2] += max(dur - nested, 0.0)

            for start, dur, name in events:
                while stack and stack[-1][0] <= start:
                    close(stack.pop())
                if stack:
                    stack[-1][3] += dur
                stack.append([start + dur, name, dur, 0.0])
            while stack:
                close(stack.pop())
    rows = [{"thread": th, "name": n, "count": c, "inclusive_us": i / 1e3, "self_us": s / 1e3}
            for (th, n), (c, i, s) in totals.items()]
    return sorted(rows, key=lambda r: -r["self_us"])


def traced_kernel_events(call, n: int, warmup: int = 3) -> list:
    """Device kernel events (name, start ns, duration ns) of ``n`` calls dispatched back to back
    under the JAX profiler, after ``warmup`` blocked calls (empty off the GPU)."""
    import tempfile

    for _ in range(warmup):
        jax.block_until_ready(call())
    trace_dir = tempfile.mkdtemp(prefix="kernel-trace-")
    with jax.profiler.trace(trace_dir):
        out = None
        for _ in range(n):
            out = call()
        jax.block_until_ready(out)
    return device_kernel_events(trace_dir)


def device_us_per_call(call, n: int = 50, warmup: int = 3) -> tuple[float, str]:
    """Device time per call of ``call()`` (which dispatches one jitted call and returns its
    result): the summed durations of the GPU kernels it launched, from a profiler trace of n
    calls, so launch gaps and host dispatch are left out and nothing is fused across calls (an
    unrolled chain of pure calls lets XLA merge them; a while loop adds its own per-iteration
    cost).  Off the GPU, with no kernel events, the median wall time per blocked call instead.
    Returns (us, method)."""
    events = traced_kernel_events(call, n, warmup) if jax.default_backend() == "gpu" else []
    if events:
        return sum(d for _, _, d in events) / n / 1e3, "profiler: kernel durations per call"
    return time_fn(lambda: jax.block_until_ready(call()), warmup=1, iters=n) * 1e6, "wall time per blocked call"


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written.

    Timed as a chain of copies (each reads the previous output) so that no host round trip or
    launch latency sits between them: the ceiling, not the ceiling plus a sync per copy."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    state = {"x": x}

    def step():
        state["x"] = f(state["x"])
        return state["x"]

    t = time_chain(step, 10)
    return 2 * nbytes / t


def random_model(cfg, dtype=jnp.bfloat16, seed: int = 0):
    """A model of cfg's shape with N(0, 0.02) weights (norm weights 1), built on device in one jit."""
    from dspark_jax.models.qwen3 import abstract_model

    graphdef, abs_state = nnx.split(abstract_model(cfg, dtype))
    leaves, treedef = jax.tree.flatten(abs_state)

    @jax.jit
    def init(key):
        keys = jax.random.split(key, len(leaves))
        out = []
        for k, leaf in zip(keys, leaves):
            if leaf.ndim >= 2:
                out.append((0.02 * jax.random.normal(k, leaf.shape, jnp.float32)).astype(leaf.dtype))
            else:
                out.append(jnp.ones(leaf.shape, leaf.dtype))
        return out

    state = jax.tree.unflatten(treedef, init(jax.random.PRNGKey(seed)))
    return nnx.merge(graphdef, state)


def gpu_warmup(seconds: float = 2.0, size: int = 8192) -> None:
    """Run matrix products for a while so the SM clock leaves idle before anything is timed."""
    a = jax.random.normal(jax.random.PRNGKey(2), (size, size), jnp.bfloat16)
    f = jax.jit(lambda x: (x @ x) * 1e-3)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = f(a)
        a.block_until_ready()


def result_dirs(out_dirs=()) -> list[Path]:
    """Where a benchmark writes its results: ``out_dirs`` when any is given, else benchmarks/results."""
    return [Path(d) for d in out_dirs] or [RESULTS]


def write_results(name: str, payload: dict, table_md: str, out_dirs=()) -> list[Path]:
    """JSON + markdown into each of ``out_dirs``, or into benchmarks/results when none is given
    (a run pointed elsewhere, such as a CPU smoke test or a device run's $OUT, leaves the
    repository's results alone: measured files are copied in by hand after reading them)."""
    paths = []
    for d in result_dirs(out_dirs):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
        (d / f"{name}.md").write_text(table_md)
        paths += [d / f"{name}.json", d / f"{name}.md"]
    return paths


def exit_if_check_failed(ok: bool, name: str, env: dict, check, out_dirs=()) -> None:
    """A kernel benchmark times nothing after a failed correctness check: the check's records
    become the run's results and the process exits with status 2."""
    if ok:
        return
    print("CHECK FAILED: nothing timed", flush=True)
    write_results(name, dict(env=env, check=check, status="check failed"), "# check failed\n", out_dirs)
    sys.exit(2)


def add_backend_args(ap) -> None:
    """--kernels, as the server and the CLI take it (dspark_jax/server_args.py)."""
    from dspark_jax.engine import EngineConfig

    ap.add_argument("--kernels", default=EngineConfig().kernels, choices=("auto", "pallas", "reference"),
                    help="Pallas kernels: auto (on the GPU), pallas or reference (plain jnp)")


def backend_kwargs(args) -> dict:
    """The EngineConfig keyword arguments of the flags ``add_backend_args`` added."""
    return {"kernels": args.kernels}
