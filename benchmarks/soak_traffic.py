"""What the soak test sends and how it judges each answer: random requests of every kind (good,
disconnecting, bad) reproducible from a seed, and the checks a correct response must pass."""

from __future__ import annotations

import dataclasses
import json
import random
import time

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
            if req.endpoint != "generate":  # a stream that ends before its disconnect is checked like any other
                req.body["stream_options"] = {"include_usage": True}
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
        if (self.req.body.get("stream_options") or {}).get("include_usage"):
            c.expect(self.usage is not None, "no usage chunk")
        else:  # OpenAI sends usage in a stream only when stream_options asks for it
            c.expect(self.usage is None, "a usage chunk not asked for")
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
