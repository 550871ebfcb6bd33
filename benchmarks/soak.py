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
import dataclasses
import datetime as dt
import importlib.metadata
import json
import os
import platform
import random
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.load_generator import check_loopback, percentiles  # noqa: E402

PROMPTS = [
    "def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "class Stack:\n    def push(self, x):",
    "Once upon a time, in a small village,", "SELECT name FROM users WHERE", "for i in range(10):",
    "The capital of France is", "x = [1, 2, 3]\ny =", "# a function that sorts a list\n",
]
STOPS = ["\n", "))", "def", " the", ":", "  "]
FINISHED = ("stop", "length")


# -- what to send ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Req:
    """One request and what a correct answer looks like."""

    scenario: str  # "ok", "disconnect" or "bad"
    endpoint: str  # "completions", "chat", "generate"
    path: str
    body: dict | bytes
    stream: bool = False
    method: str = "POST"
    expect_status: int = 200
    label: str = ""  # a bad request's kind
    choices: int = 1
    max_tokens: int = 16
    echo: list | None = None  # completions echo: each prompt's text (None for token-id prompts)
    many: bool = False  # /generate answers a list (a batch, or n > 1)
    disconnect_after: int = 0  # chunks read before closing the connection


class Traffic:
    """Random requests, reproducible from one seed per client."""

    def __init__(self, rng: random.Random, info: dict, id_pool: list[int], max_tokens: int, bad_rate: float,
                 disconnect_rate: float):
        self.rng, self.info, self.ids, self.max_tokens = rng, info, id_pool, max_tokens
        self.bad_rate, self.disconnect_rate = bad_rate, disconnect_rate

    def next(self) -> Req:
        r = self.rng.random()
        if r < self.bad_rate:
            return self.bad()
        req = self.good()
        if r < self.bad_rate + self.disconnect_rate:
            req.stream, req.scenario, req.disconnect_after = True, "disconnect", self.rng.randint(1, 4)
            req.body["stream"] = True
        return req

    # sampling parameters, OpenAI names
    def sampling(self) -> dict:
        rng = self.rng
        p = {"temperature": rng.choice([0, 0, 0.7, 1.0])}
        if rng.random() < 0.3:
            p["top_k"] = rng.choice([1, 20, 50])
        if rng.random() < 0.3:
            p["top_p"] = rng.choice([0.9, 0.95])
        if rng.random() < 0.5:
            p["seed"] = rng.randrange(2**32)
        if rng.random() < 0.25:
            p["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        if rng.random() < 0.5:
            p["ignore_eos"] = True
        if rng.random() < 0.15:  # logit processors (penalties, logit_bias)
            p[rng.choice(["presence_penalty", "frequency_penalty"])] = rng.choice([-0.5, 0.5, 1.5])
            p["repetition_penalty"] = rng.choice([1.0, 1.2])
            p["logit_bias"] = {str(rng.choice(self.ids)): rng.choice([-100.0, -2.0, 3.0])}
        return p

    def prompt_ids(self) -> list[int]:
        start = self.rng.randrange(len(self.ids))
        return (self.ids * 2)[start:start + self.rng.randint(3, 24)]

    def good(self) -> Req:
        rng = self.rng
        endpoint = rng.choices(["completions", "chat", "generate"], weights=[5, 3, 2])[0]
        stream = rng.random() < 0.5
        n = rng.choice([1, 1, 1, 2, 3])
        max_tokens = rng.randint(1, self.max_tokens)
        sp = self.sampling()
        if endpoint == "generate":
            batch = rng.choice([None, None, 2, 3])
            key = rng.choice(["text", "input_ids"])
            one = (lambda: rng.choice(PROMPTS)) if key == "text" else self.prompt_ids
            prompt = one() if batch is None else [one() for _ in range(batch)]
            sp = {"max_new_tokens": max_tokens, "n": n, **sp}
            body = {key: prompt, "sampling_params": sp, "stream": stream}
            return Req("ok", endpoint, "/generate", body, stream, choices=n * (batch or 1), max_tokens=max_tokens,
                       many=batch is not None or n > 1)
        body = {"max_tokens": max_tokens, "n": n, "stream": stream, **sp}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.2:
            body["user"] = f"soak-{rng.randrange(1000)}"
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
            if rng.random() < 0.15:
                body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
            return Req("ok", endpoint, "/v1/chat/completions", body, stream, choices=n, max_tokens=max_tokens)
        kind = rng.choice(["text", "text", "ids", "text batch", "ids batch"])
        batch = rng.randint(2, 3) if "batch" in kind else 1
        prompts = [rng.choice(PROMPTS) if kind.startswith("text") else self.prompt_ids() for _ in range(batch)]
        body["prompt"] = prompts if "batch" in kind else prompts[0]
        echo = None
        if rng.random() < 0.25:
            body["echo"] = True
            echo = [p if isinstance(p, str) else None for p in prompts]
        if rng.random() < 0.1:
            body["best_of"] = n
        if echo is None and rng.random() < 0.15:
            body["logprobs"] = rng.randint(0, 5)
        return Req("ok", endpoint, "/v1/completions", body, stream, choices=n * batch, max_tokens=max_tokens, echo=echo)

    def bad(self) -> Req:
        rng, info = self.rng, self.info
        hi = {"prompt": "hi", "max_tokens": 4}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        cases = [
            ("malformed json", "/v1/completions", b'{"prompt": "hi", "max_tokens": 4', 400),
            ("lone surrogate", "/v1/completions", b'{"prompt": "hi \\ud800 there"}', 400),
            ("lone surrogate", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400),
            ("huge int", "/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400),
            ("huge int", "/generate", b'{"text": "hi", "sampling_params": {"seed": ' + b"7" * 300 + b"}}", 400),
            ("deep nesting", "/v1/completions", b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
            ("logprobs over 20", "/v1/completions", {**hi, "logprobs": 21}, 400),
            ("penalty out of range", "/v1/chat/completions", {**chat, "presence_penalty": 2.5}, 400),
            ("min_tokens over max_tokens", "/v1/completions", {**hi, "min_tokens": 5}, 400),
            ("logit_bias outside the vocabulary", "/v1/chat/completions", {**chat, "logit_bias": {"999999999": 1.0}},
             400),
            ("invalid json schema", "/v1/chat/completions", {**chat, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, 400),
            ("refused tools", "/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
            ("invalid regex", "/generate", {"text": "hi", "sampling_params": {"regex": "a("}}, 400),
            ("refused ebnf", "/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= 'a'"}}, 400),
            ("best_of > n streamed", "/v1/completions", {**hi, "n": 1, "best_of": 3, "stream": True}, 400),
            ("n too large", "/v1/completions", {**hi, "n": info.get("max_choices", 128) + 1}, 400),
            ("unknown field", "/v1/completions", {**hi, "frobnicate": 1}, 400),
            ("wrong type", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "8"}}, 400),
            ("unknown model", "/v1/completions", {**hi, "model": "no-such-model"}, 404),
            ("over the context", "/v1/completions", {"prompt": [self.ids[0]] * (info["max_model_len"] + 1)}, 400),
            ("empty batch prompt", "/v1/completions", {"prompt": ["a", ""]}, 400),
            ("oversize body", "/v1/completions", None, 413),
            ("wrong method", "/v1/completions", None, 405),
            ("unknown path", "/v1/nothing", {}, 404),
        ]
        label, path, body, status = rng.choice(cases)
        endpoint = {"/generate": "generate", "/v1/chat/completions": "chat"}.get(path, "completions")
        method = "POST"
        if label == "oversize body":
            body = b'{"prompt": "' + b"a" * (info.get("max_body_bytes", 4 << 20) + 1024) + b'"}'
        elif label == "wrong method":
            method, body = "GET", b""
        return Req("bad", endpoint, path, body, method=method, expect_status=status, label=label)


# -- sending it and checking the answer ------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    req: Req
    ok: bool
    status: int | None = None
    error: str | None = None
    latency: float = 0.0
    ttft: float | None = None
    itl: list = dataclasses.field(default_factory=list)
    completion_tokens: int = 0


class Checker:
    """Collects the problems of one answer."""

    def __init__(self):
        self.problems: list[str] = []

    def expect(self, cond: bool, what: str) -> None:
        if not cond:
            self.problems.append(what)


def check_body(req: Req, body, c: Checker) -> int:
    """A non-streamed 200 answer; returns its completion tokens."""
    if req.endpoint == "generate":
        items = body if isinstance(body, list) else [body]
        c.expect(isinstance(body, list) == req.many and len(items) == req.choices, f"{len(items)} items")
        for it in items:
            fin = (it["meta_info"]["finish_reason"] or {}).get("type")
            c.expect(fin in FINISHED, f"finish {fin}")
            c.expect(len(it["output_ids"]) <= req.max_tokens, f"{len(it['output_ids'])} ids > {req.max_tokens}")
        return sum(len(it["output_ids"]) for it in items)
    choices = body["choices"]
    c.expect([ch["index"] for ch in choices] == list(range(req.choices)), f"indexes {[ch['index'] for ch in choices]}")
    c.expect(all(ch["finish_reason"] in FINISHED for ch in choices), "finish reasons")
    n = req.choices // len(req.echo) if req.echo else 1
    for ch in choices:
        if req.echo and req.echo[ch["index"] // n] is not None:
            c.expect(ch["text"].startswith(req.echo[ch["index"] // n]), "echo missing")
    used = body["usage"]["completion_tokens"]
    c.expect(0 <= used <= req.choices * req.max_tokens, f"usage {used}")
    return used


class StreamState:
    """Per-choice progress of a stream: first-token and inter-token times, finish reasons."""

    def __init__(self, req: Req, t0: float):
        self.req, self.t0 = req, t0
        self.first: float | None = None
        self.last: dict[int, float] = {}
        self.itl: list[float] = []
        self.finish: dict[int, str] = {}
        self.skip_echo = set(range(req.choices)) if req.echo else set()
        self.gen_len: dict[int, int] = {}
        self.gen_tokens: dict[int, int] = {}
        self.usage: int | None = None

    def content(self, i: int) -> None:
        now = time.perf_counter()
        if i in self.skip_echo:  # the echoed prompt, not a generated token
            self.skip_echo.discard(i)
            return
        if self.first is None:
            self.first = now
        if i in self.last:
            self.itl.append(now - self.last[i])
        self.last[i] = now

    def chunk(self, obj: dict, c: Checker) -> None:
        if "error" in obj:
            c.expect(False, f"error event: {obj['error'].get('message', '')[:200]}")
            return
        if self.req.endpoint == "generate":
            i = obj.get("index", 0)
            if len(obj["text"]) > self.gen_len.get(i, 0) or (obj["output_ids"] and i not in self.last):
                self.content(i)
            self.gen_len[i] = len(obj["text"])
            fin = obj["meta_info"]["finish_reason"]
            if fin:
                self.finish[i] = fin["type"]
                self.gen_tokens[i] = obj["meta_info"]["completion_tokens"]
            return
        if obj.get("usage"):
            self.usage = obj["usage"]["completion_tokens"]
        for ch in obj.get("choices", []):
            text = ch.get("text") if self.req.endpoint == "completions" else ch.get("delta", {}).get("content")
            if text:
                self.content(ch["index"])
            if ch.get("finish_reason"):
                self.finish[ch["index"]] = ch["finish_reason"]

    def close(self, c: Checker, done: bool) -> int:
        c.expect(done, "no [DONE]")
        c.expect(sorted(self.finish) == list(range(self.req.choices)), f"finished choices {sorted(self.finish)}")
        c.expect(all(f in FINISHED for f in self.finish.values()), f"finish reasons {set(self.finish.values())}")
        if self.req.endpoint == "generate":
            return sum(self.gen_tokens.values())
        c.expect(self.usage is not None, "no usage chunk")
        used = self.usage or 0
        c.expect(used <= self.req.choices * self.req.max_tokens, f"usage {used}")
        return used


async def send(client, base: str, req: Req) -> Outcome:
    t0 = time.perf_counter()
    c = Checker()
    kw = {"content": req.body, "headers": {"content-type": "application/json"}} if isinstance(req.body, bytes) \
        else {"json": req.body}
    out = Outcome(req, ok=False)
    try:
        async with client.stream(req.method, base + req.path, **kw) as resp:
            out.status = resp.status_code
            if resp.status_code != 200 or not req.stream:
                raw = await resp.aread()
                c.expect(resp.status_code == req.expect_status, f"HTTP {resp.status_code}, expected "
                         f"{req.expect_status}: {raw[:200]!r}")
                if resp.status_code == req.expect_status != 200:
                    err = json.loads(raw).get("error", {})
                    c.expect(bool(err.get("message")) and "type" in err, "error body")
                elif resp.status_code == 200:
                    out.completion_tokens = check_body(req, json.loads(raw), c)
            else:
                st, done, chunks = StreamState(req, t0), False, 0
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    st.chunk(json.loads(line[6:]), c)
                    chunks += 1
                    if req.disconnect_after and chunks >= req.disconnect_after:
                        break  # leaving the block closes the connection mid-stream
                if not (req.disconnect_after and not done):
                    out.completion_tokens = st.close(c, done)
                out.ttft = st.first - t0 if st.first is not None else None
                out.itl = st.itl
    except Exception as e:  # noqa: BLE001 - recorded as a failure
        c.expect(False, f"{type(e).__name__}: {e}"[:300])
    out.latency = time.perf_counter() - t0
    out.ok = not c.problems
    out.error = "; ".join(c.problems) or None
    return out


# -- the server: started here or given ---------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(server_args: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "serving.launch", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *shlex.split(server_args)]
    print("starting:", " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


async def wait_healthy(client, base: str, proc, timeout: float, log_path: Path | None) -> None:
    t0 = time.time()
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path else ""
            raise SystemExit(f"the server exited with status {proc.returncode} before it was healthy:\n{tail}")
        try:
            if (await client.get(base + "/health", timeout=2)).status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.time() - t0 > timeout:
            raise SystemExit(f"the server was not healthy within {timeout:.0f} s")
        await asyncio.sleep(0.5)


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
    proc, base = (None, args.url.rstrip("/")) if args.url else start_server(args.server_args, log_path)
    check_loopback(base)
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams + 8)
    timeout = httpx.Timeout(args.duration_s + args.grace_s + 60, connect=30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t_boot = time.perf_counter()
        await wait_healthy(client, base, proc, args.startup_timeout_s, log_path if proc else None)
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
        proc.terminate()
        try:
            exit_code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = proc.wait()
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


def git_commit() -> str:
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "serving", "dspark_jax"], cwd=REPO).returncode
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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
