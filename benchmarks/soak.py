"""Soak test of the dspark-jax server: many concurrent clients of every kind for a bounded time.

    python benchmarks/soak.py                                   # starts `python -m serving.launch` itself
    python benchmarks/soak.py --streams 64 --duration-s 180 --name soak_cpu
    python benchmarks/soak.py --url http://127.0.0.1:30000      # a server already running (loopback only)
    python benchmarks/soak.py --server-args "--max-running-requests 32 --verify-mode static"

Each of --streams clients loops until --duration-s: streaming and non-streaming requests to
/v1/completions, /v1/chat/completions and /generate with mixed parameters (temperature, top_k,
top_p, seeds, stop strings, penalties, logit_bias, logprobs, n, best_of = n, echo, batched
prompts of text or token ids, user);
clients that disconnect mid-stream; and bad requests (malformed JSON, lone surrogates, huge
integers, bodies over the server's limit, refused parameters, unknown models, prompts over the
context), each expecting its 4xx.  A failure is any other status, an exception, a mid-stream
error or a malformed answer; the goal is none.

Recorded: output throughput, TTFT and inter-token latency percentiles (per choice), the server
process's RSS and generation throughput over time (psutil if installed, else /proc), and, after
the run, whether the server is back to idle (/server_info and /metrics: no running or queued
requests, no KV pages in use, every slot free).  Writes <out>/<name>.json, .md and .png.
Exit status 0 only with no failure and an idle server at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import git_commit  # noqa: E402
from benchmarks.load_generator import check_loopback, percentiles  # noqa: E402
from benchmarks.server_process import launch, stop, wait_healthy  # noqa: E402
from benchmarks.soak_traffic import PROMPTS, Outcome, Traffic, send  # noqa: E402

# -- the server: started here or given ---------------------------------------------------------------

class ProcessProbe:
    """The server process's RSS (psutil, else /proc) and CPU share since the last call (psutil
    only); the host's 1-minute load average says whether others shared the cores."""

    def __init__(self, pid: int | None):
        self.pid, self.proc = pid, None
        try:
            import psutil

            self.proc = psutil.Process(pid) if pid else None
            if self.proc is not None:
                self.proc.cpu_percent()  # starts the interval
        except Exception:  # noqa: BLE001 - no psutil, or no such process: /proc below
            self.proc = None

    def sample(self) -> dict:
        row = {"rss_mib": None, "server_cpu_pct": None,
               "load1": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
        try:
            if self.proc is not None:
                row["rss_mib"] = round(self.proc.memory_info().rss / 2**20, 1)
                row["server_cpu_pct"] = round(self.proc.cpu_percent(), 1)
            elif self.pid:
                for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        row["rss_mib"] = round(int(line.split()[1]) / 1024, 1)
        except Exception:  # noqa: BLE001 - the process is gone: a gap in the series
            pass
        return row


_METRIC = re.compile(r"^(dspark:[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)


async def server_metrics(client, base: str) -> dict:
    text = (await client.get(base + "/metrics", timeout=30)).text
    return {m.group(1): float(m.group(2)) for m in _METRIC.finditer(text)}


IDLE_KEYS = ("num_running_reqs", "num_queue_reqs", "kv_used_pages", "active_streams")


async def wait_idle(client, base: str, timeout: float) -> dict:
    """Poll until nothing runs and every page and slot is free; what was seen last."""
    t0, seen = time.time(), {}
    while time.time() - t0 < timeout:
        st = (await client.get(base + "/server_info", timeout=30)).json()["internal_states"][0]
        m = await server_metrics(client, base)
        seen = {**{k: st[k] for k in IDLE_KEYS}, "free_slots": st.get("free_slots"), "total_slots": st.get("total_slots"),
                "metrics_running": m.get("dspark:num_running_reqs"), "metrics_kv_used_pages": m.get("dspark:kv_used_pages")}
        idle = all(seen[k] == 0 for k in IDLE_KEYS) and seen["free_slots"] == seen["total_slots"] \
            and seen["metrics_running"] == 0 and seen["metrics_kv_used_pages"] == 0
        if idle:
            return {**seen, "idle": True, "seconds_to_idle": round(time.time() - t0, 2)}
        await asyncio.sleep(0.25)
    return {**seen, "idle": False, "seconds_to_idle": None}


# -- the run ---------------------------------------------------------------------------------------------

async def soak(args) -> dict:
    import httpx

    log_path = Path(tempfile.mkstemp(prefix="soak_server_", suffix=".log")[1])
    proc, base = (None, args.url.rstrip("/")) if args.url else launch(
        ["--log-level", "warning", *shlex.split(args.server_args)], log_path)
    check_loopback(base)
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    timeout = httpx.Timeout(args.duration_s + args.grace_s + 60, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t_boot = time.perf_counter()
        await asyncio.to_thread(wait_healthy, proc, base, args.startup_timeout_s, log_path if proc else None)
        boot_s = time.perf_counter() - t_boot
        info = (await client.get(base + "/server_info")).json()
        pid = info.get("pid") or (proc.pid if proc else None)
        warm = (await client.post(base + "/generate", json={"text": " ".join(PROMPTS), "sampling_params": {
            "max_new_tokens": 8, "temperature": 0}})).json()
        id_pool = [t for t in warm["output_ids"] if t < info.get("vocab_size", 1 << 30)] or [1]
        id_pool += (await client.post(base + "/generate", json={"text": PROMPTS[0], "sampling_params": {
            "max_new_tokens": 32, "temperature": 1.0, "seed": 1, "ignore_eos": True}})).json()["output_ids"]
        outcomes: list[Outcome] = []
        series: list[dict] = []
        t_start = time.perf_counter()
        deadline = t_start + args.duration_s
        stop_sampling = asyncio.Event()

        async def client_loop(i: int):
            traffic = Traffic(random.Random(args.seed * 100_003 + i), info, id_pool, args.max_tokens, args.bad_rate,
                              args.disconnect_rate)
            while time.perf_counter() < deadline:
                outcomes.append(await send(client, base, traffic.next()))

        probe = ProcessProbe(pid)

        async def sampler(bar):
            prev = None
            while True:
                t = time.perf_counter() - t_start
                row = {"t_s": round(t, 2), **probe.sample()}
                try:
                    m = await server_metrics(client, base)
                    row.update(running=m.get("dspark:num_running_reqs"), queued=m.get("dspark:num_queue_reqs"),
                               kv_used_pages=m.get("dspark:kv_used_pages"), gen_tokens=m.get("dspark:generation_tokens_total"))
                except Exception as e:  # noqa: BLE001 - a gap in the series, not a failure
                    row["error"] = repr(e)[:100]
                if prev is not None and row.get("gen_tokens") is not None and prev.get("gen_tokens") is not None:
                    row["gen_tok_s"] = round((row["gen_tokens"] - prev["gen_tokens"]) / max(1e-9, row["t_s"] - prev["t_s"]), 1)
                series.append(row)
                prev = row if row.get("gen_tokens") is not None else prev
                if bar is not None:
                    bar.n = min(args.duration_s, int(t))
                    fails = sum(not o.ok for o in outcomes)
                    bar.set_postfix_str(f"req {len(outcomes)} fail {fails} tok/s {row.get('gen_tok_s', 0) or 0:.0f} "
                                        f"rss {row['rss_mib'] or 0:.0f} MiB run {row.get('running', 0):.0f} "
                                        f"queue {row.get('queued', 0):.0f}")
                if stop_sampling.is_set():
                    return
                try:
                    await asyncio.wait_for(stop_sampling.wait(), args.sample_s)
                except TimeoutError:
                    pass

        bar = None
        if args.progress:
            from tqdm import tqdm

            bar = tqdm(total=int(args.duration_s), desc="soak", unit="s", dynamic_ncols=True, file=sys.stderr)
        sampler_task = asyncio.create_task(sampler(bar))
        tasks = [asyncio.create_task(client_loop(i)) for i in range(args.streams)]
        done, pending = await asyncio.wait(tasks, timeout=args.duration_s + args.grace_s)
        for t in pending:  # still waiting past the grace: closed, which aborts them on the server
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t_start
        crashed = [repr(t.exception())[:300] for t in done if not t.cancelled() and t.exception() is not None]
        idle = await wait_idle(client, base, args.idle_timeout_s)
        stop_sampling.set()
        await sampler_task
        if bar is not None:
            bar.n = int(args.duration_s)
            bar.close()
        health = (await client.get(base + "/health")).status_code
        final_info = (await client.get(base + "/server_info")).json()
    exit_code = None
    if proc is not None:
        exit_code = stop(proc)
    rep = report(args, info, final_info, outcomes, series, idle, wall, boot_s, health, exit_code, crashed, len(pending))
    if proc is not None and (rep["failures"] or exit_code):
        print(f"the server's log: {log_path}", flush=True)
    return rep


def report(args, info, final_info, outcomes, series, idle, wall, boot_s, health, exit_code, crashed, cut):
    ok = [o for o in outcomes if o.ok]
    fails = [o for o in outcomes if not o.ok]
    by = lambda key: {k: sum(1 for o in outcomes if str(key(o)) == k) for k in sorted({str(key(o)) for o in outcomes})}
    tokens = sum(o.completion_tokens for o in ok)
    rss = [r["rss_mib"] for r in series if r.get("rss_mib")]
    tput = [r["gen_tok_s"] for r in series if r.get("gen_tok_s") is not None]
    third = max(1, len(rss) // 3)
    failures = [{"scenario": o.req.scenario, "endpoint": o.req.endpoint, "label": o.req.label, "status": o.status,
                 "stream": o.req.stream, "error": o.error,
                 "body": (o.req.body[:200].decode("utf-8", "replace") if isinstance(o.req.body, bytes)
                          else json.dumps(o.req.body)[:300])} for o in fails[:50]]
    failures += [{"scenario": "client task", "error": e} for e in crashed]
    versions = {"python": platform.python_version(), "jax": final_info.get("jax_version")}
    for pkg in ("fastapi", "uvicorn", "httpx", "psutil"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "benchmark": "soak",
        "device": final_info.get("device"),
        "versions": versions,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "config": {k: v for k, v in vars(args).items()},
        "server": {k: info.get(k) for k in ("served_model_name", "model_path", "speculative_algorithm", "verify_mode",
                                            "block_size", "max_running_requests", "max_model_len", "page_size",
                                            "num_pages", "compile_seconds", "max_choices")},
        "startup_s": round(boot_s, 1),
        "wall_s": round(wall, 1),
        "requests": len(outcomes), "requests_ok": len(ok), "failures": len(fails) + len(crashed),
        "clients_cut_at_grace": cut,
        "by_scenario": by(lambda o: o.req.scenario), "by_endpoint": by(lambda o: o.req.endpoint),
        "streamed": sum(o.req.stream for o in outcomes),
        "bad_by_status": {k: v for k, v in by(lambda o: o.status if o.req.scenario == "bad" else "-").items() if k != "-"},
        "bad_by_kind": {k: v for k, v in by(lambda o: o.req.label or "-").items() if k != "-"},
        "choices_served": sum(o.req.choices for o in ok if o.req.scenario == "ok"),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 1) if wall else None,
        "server_gen_tok_s": {"mean": round(sum(tput) / len(tput), 1) if tput else None,
                             "max": max(tput) if tput else None},
        "ttft_ms": percentiles([o.ttft for o in ok if o.ttft is not None]),
        "itl_ms": percentiles([x for o in ok for x in o.itl]),
        "e2e_ms": percentiles([o.latency for o in ok if o.req.scenario == "ok"]),
        "rss_mib": {"start": rss[0] if rss else None, "end": rss[-1] if rss else None, "max": max(rss) if rss else None,
                    "first_third_mean": round(sum(rss[:third]) / third, 1) if rss else None,
                    "last_third_mean": round(sum(rss[-third:]) / third, 1) if rss else None},
        "host_load1": summary([r["load1"] for r in series if r.get("load1") is not None]),
        "server_cpu_pct": summary([r["server_cpu_pct"] for r in series if r.get("server_cpu_pct") is not None]),
        "idle_at_end": idle,
        "health_at_end": health,
        "server_exit_code": exit_code,
        "failure_samples": failures,
        "series": series,
    }


def summary(xs: list) -> dict:
    return {"mean": round(sum(xs) / len(xs), 2), "max": max(xs)} if xs else {"mean": None, "max": None}


def markdown(rep: dict) -> str:
    s, c = rep["server"], rep["config"]
    fmt = lambda p: " / ".join("-" if p[k] is None else f"{p[k]:.0f}" for k in ("p50", "p90", "p99"))
    idle = rep["idle_at_end"]
    rows = [
        ("load", f"{c['streams']} concurrent clients for {c['duration_s']:.0f} s (wall {rep['wall_s']} s)"),
        ("requests", f"{rep['requests']}: " + ", ".join(f"{k} {v}" for k, v in rep["by_scenario"].items())
         + f"; streamed {rep['streamed']}; choices served {rep['choices_served']}"),
        ("failures", f"**{rep['failures']}**"),
        ("bad requests by status", ", ".join(f"{k}: {v}" for k, v in rep["bad_by_status"].items()) or "-"),
        ("output throughput", f"{rep['output_tok_s']} tok/s (client, finished requests); server mean "
                              f"{rep['server_gen_tok_s']['mean']} tok/s, max {rep['server_gen_tok_s']['max']}"),
        ("TTFT p50 / p90 / p99", f"{fmt(rep['ttft_ms'])} ms"),
        ("inter-token p50 / p90 / p99", f"{fmt(rep['itl_ms'])} ms"),
        ("request latency p50 / p90 / p99", f"{fmt(rep['e2e_ms'])} ms"),
        ("server RSS", "start {start} MiB, end {end} MiB, max {max} MiB; first third mean {first_third_mean}, "
                       "last third mean {last_third_mean}".format(**rep["rss_mib"])),
        ("host sharing", f"1-min load average mean {rep['host_load1']['mean']}, max {rep['host_load1']['max']} "
                         f"(cores: {rep['device']}); server process CPU mean {rep['server_cpu_pct']['mean']}%"),
        ("idle at the end", f"{'yes' if idle['idle'] else '**no**'} (running {idle.get('num_running_reqs')}, queued "
                            f"{idle.get('num_queue_reqs')}, KV pages used {idle.get('kv_used_pages')}, free slots "
                            f"{idle.get('free_slots')}/{idle.get('total_slots')}; after {idle.get('seconds_to_idle')} s)"),
    ]
    head = (f"# Soak: {s['served_model_name']} ({s['speculative_algorithm']}"
            f"{', ' + s['verify_mode'] if s['verify_mode'] else ''}), {rep['device']}\n\n"
            f"jax {rep['versions']['jax']}, python {rep['versions']['python']}, {rep['date']}, commit {rep['commit']}; "
            f"max running {s['max_running_requests']}, context {s['max_model_len']}, max tokens per choice "
            f"{c['max_tokens']}, bad {c['bad_rate']:.0%}, disconnects {c['disconnect_rate']:.0%}.\n\n")
    return head + "| what | measured |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


def plot(rep: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ser = rep["series"]
    fig, (a, b, h) = plt.subplots(3, 1, figsize=(9, 8), sharex=True, height_ratios=(2, 2, 1.3))
    pts = [(r["t_s"], r["rss_mib"]) for r in ser if r.get("rss_mib")]
    if pts:
        a.plot(*zip(*pts), color="tab:blue")
    a.set_ylabel("server RSS (MiB)")
    a.set_title(f"soak: {rep['config']['streams']} clients, {rep['device']}, {rep['failures']} failures")
    pts = [(r["t_s"], r["gen_tok_s"]) for r in ser if r.get("gen_tok_s") is not None]
    if pts:
        b.plot(*zip(*pts), color="tab:green", label="generated tok/s")
    b.set_ylabel("server tok/s")
    for key, color, label in (("running", "tab:gray", "running requests"), ("load1", "tab:orange", "host load (1 min)"),
                              ("server_cpu_pct", "tab:purple", "server CPU / 100%")):
        pts = [(r["t_s"], r[key] / (100 if key == "server_cpu_pct" else 1)) for r in ser if r.get(key) is not None]
        if pts:
            h.plot(*zip(*pts), color=color, label=label)
    h.legend(loc="upper left", fontsize=8, ncol=3)
    h.set_xlabel("seconds (dashed: end of the load window)")
    for ax in (a, b, h):
        ax.axvline(rep["config"]["duration_s"], color="tab:red", lw=0.8, ls="--")  # no new requests after
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (loopback only); default: start python -m serving.launch")
    ap.add_argument("--server-args", default="", help="flags for the server this starts, e.g. \"--no-precompile\"")
    ap.add_argument("--streams", type=int, default=256, help="concurrent clients")
    ap.add_argument("--duration-s", type=float, default=600.0, help="no request starts after this")
    ap.add_argument("--grace-s", type=float, default=120.0, help="then this long for requests in flight, "
                                                                  "after which they are closed (aborted)")
    ap.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens a request asks for")
    ap.add_argument("--bad-rate", type=float, default=0.1, help="fraction of bad requests")
    ap.add_argument("--disconnect-rate", type=float, default=0.1, help="fraction of streams closed mid-way")
    ap.add_argument("--sample-s", type=float, default=1.0, help="RSS and /metrics sampling period")
    ap.add_argument("--startup-timeout-s", type=float, default=1200.0)
    ap.add_argument("--idle-timeout-s", type=float, default=60.0, help="how long the server may take to be idle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="folder for the result files")
    ap.add_argument("--name", default="soak", help="result file stem")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty())
    args = ap.parse_args(argv)
    if args.streams < 1 or args.duration_s <= 0 or not 0 <= args.bad_rate + args.disconnect_rate <= 1:
        ap.error("--streams and --duration-s must be positive, and --bad-rate + --disconnect-rate in [0, 1]")
    if args.url:
        check_loopback(args.url)
    rep = asyncio.run(soak(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(rep, indent=1))
    md = markdown(rep)
    has_png = plot(rep, out / f"{args.name}.png")
    (out / f"{args.name}.md").write_text(md + (f"\n![RSS and throughput over time]({args.name}.png)\n" if has_png else ""))
    print(md)
    for f in rep["failure_samples"][:10]:
        print("failure:", json.dumps(f)[:400])
    ok = rep["failures"] == 0 and rep["idle_at_end"]["idle"] and rep["health_at_end"] == 200
    return 0 if ok and rep["server_exit_code"] in (None, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
