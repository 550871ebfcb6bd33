"""Load generator for the dspark-jax server: concurrent streaming /v1/completions requests.

Bounded in requests (--num-requests) and time (--duration: no request starts after it, and
unfinished ones are cancelled at --duration + --grace), loopback only.  Reports throughput,
TTFT and inter-token latency (ITL) percentiles as JSON (--out) and a printed table.

    python -m serving.launch &                       # port 30000
    python benchmarks/load_generator.py --num-requests 64 --concurrency 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import sys
import time
from urllib.parse import urlparse

import numpy as np

LOOPBACK_NAMES = {"localhost"}


def check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname or ""
    if host in LOOPBACK_NAMES:
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"refusing to load {host!r}: the load generator only targets loopback addresses")


def percentiles(xs, ps=(50, 90, 99)) -> dict:
    if not xs:
        return {f"p{p}": None for p in ps} | {"mean": None}
    a = np.asarray(xs, dtype=float) * 1000.0
    return {f"p{p}": float(np.percentile(a, p)) for p in ps} | {"mean": float(a.mean())}


async def one_request(client, url, payload) -> dict:
    t0 = time.perf_counter()
    times, text, usage, finish, err = [], [], None, None, None
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                return {"ok": False, "error": f"HTTP {resp.status_code}: {body[:200]!r}", "latency": time.perf_counter() - t0}
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk.get("choices", []):
                    if c.get("text"):
                        times.append(time.perf_counter())
                        text.append(c["text"])
                    finish = c.get("finish_reason") or finish
    except Exception as e:  # noqa: BLE001 - report, do not crash the run
        err = repr(e)
    t1 = time.perf_counter()
    return {
        "ok": err is None, "error": err, "latency": t1 - t0,
        "ttft": times[0] - t0 if times else None,
        "itl": list(np.diff(times)) if len(times) > 1 else [],
        "completion_tokens": usage["completion_tokens"] if usage else None,
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
        "finish_reason": finish,
    }


async def run(args) -> dict:
    import httpx

    check_loopback(args.base_url)
    url = args.base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(args.seed)
    words = args.prompt.split()
    sem = asyncio.Semaphore(args.concurrency)
    t_start = time.perf_counter()
    deadline = t_start + args.duration

    async def worker(i, client):
        async with sem:
            if time.perf_counter() > deadline:
                return None
            prompt = " ".join(rng.sample(words, k=len(words))) if args.shuffle_prompts else args.prompt
            payload = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens,
                       "temperature": args.temperature, "stream": True, "ignore_eos": args.ignore_eos,
                       "stream_options": {"include_usage": True}, "seed": i}
            if args.model is None:
                payload.pop("model")
            return await one_request(client, url, payload)

    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.duration + args.grace), limits=limits, trust_env=False) as client:
        tasks = [asyncio.create_task(worker(i, client)) for i in range(args.num_requests)]
        done, pending = await asyncio.wait(tasks, timeout=args.duration + args.grace)
        for t in pending:
            t.cancel()
    wall = time.perf_counter() - t_start
    results = [t.result() for t in done if not t.cancelled() and t.exception() is None and t.result() is not None]
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["completion_tokens"] or 0 for r in ok)
    in_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    return {
        "config": vars(args),
        "requests_sent": len(results), "requests_ok": len(ok), "requests_failed": len(results) - len(ok),
        "requests_cancelled_or_skipped": args.num_requests - len(results),
        "errors": [r["error"] for r in results if not r["ok"]][:10],
        "wall_s": wall,
        "output_tokens": out_tokens, "input_tokens": in_tokens,
        "output_throughput_tok_s": out_tokens / wall if wall else None,
        "request_throughput_req_s": len(ok) / wall if wall else None,
        "ttft_ms": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_ms": percentiles([x for r in ok for x in r["itl"]]),
        "e2e_latency_ms": percentiles([r["latency"] for r in ok]),
    }


def print_table(rep: dict) -> None:
    print(f"requests ok/failed/skipped: {rep['requests_ok']}/{rep['requests_failed']}/{rep['requests_cancelled_or_skipped']}"
          f"   wall {rep['wall_s']:.2f} s")
    print(f"output throughput {rep['output_throughput_tok_s'] or 0:.1f} tok/s   requests {rep['request_throughput_req_s'] or 0:.2f} req/s"
          f"   tokens in/out {rep['input_tokens']}/{rep['output_tokens']}")
    print(f"{'metric':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft_ms", "itl_ms", "e2e_latency_ms"):
        p = rep[name]
        fmt = lambda v: f"{v:10.2f}" if v is not None else f"{'-':>10}"
        print(f"{name:<16}{fmt(p['mean'])}{fmt(p['p50'])}{fmt(p['p90'])}{fmt(p['p99'])}")
    for e in rep["errors"]:
        print("error:", e)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--model", default=None, help="model name to send (default: none, the server's only model)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog while the cat watches from the warm window")
    ap.add_argument("--shuffle-prompts", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--duration", type=float, default=120.0, help="no request starts after this many seconds")
    ap.add_argument("--grace", type=float, default=30.0, help="extra seconds for in-flight requests before cancelling")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 1 or args.duration <= 0:
        ap.error("--num-requests, --concurrency and --duration must be positive")
    rep = asyncio.run(run(args))
    print_table(rep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=2)
    else:
        print(json.dumps({k: v for k, v in rep.items() if k != "config"}, indent=None))
    return 0 if rep["requests_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
