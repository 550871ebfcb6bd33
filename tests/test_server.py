"""The OpenAI-compatible server (serving/), driven over loopback with the official openai client.

One in-process server (uvicorn in a thread, on a socket bound to 127.0.0.1:0) over a tiny random
Qwen3 model serves every test in this module; one subprocess test covers `python -m
serving.launch` and graceful SIGTERM shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.conftest import write_hf_qwen3  # noqa: E402

MAX_RUNNING = 16
MAX_MODEL_LEN = 2048
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_hf_qwen3(tmp_path_factory.mktemp("srv") / "tiny-qwen3", max_pos=MAX_MODEL_LEN)


@contextlib.contextmanager
def serve_in_thread(app):
    """uvicorn in a daemon thread on a socket bound to 127.0.0.1:0; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        deadline = time.time() + 30
        while not srv.started:
            assert time.time() < deadline, "server did not start"
            assert th.is_alive(), "server thread died"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(15)
        sock.close()


@pytest.fixture(scope="module")
def server(model_dir):
    from dspark_jax.engine import Engine, EngineConfig
    from serving.app import ServerConfig, create_app

    engine = Engine.from_pretrained(model_dir, EngineConfig(max_running_requests=MAX_RUNNING, max_prefill_tokens=256,
                                                            max_model_len=MAX_MODEL_LEN))
    app = create_app(engine, ServerConfig(model_name="tiny", model_path=str(model_dir)))
    with serve_in_thread(app) as base:

        class S:
            pass

        S.base, S.tokenizer, S.state = base, engine.tokenizer, app.state.server
        yield S


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def _get(server, path):
    r = httpx.get(server.base + path, timeout=10, trust_env=False)
    return r


def _metrics(server) -> dict:
    out = {}
    for fam in text_string_to_metric_families(_get(server, "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _wait_idle(server, timeout=15.0) -> dict:
    deadline = time.time() + timeout
    while True:
        info = _get(server, "/server_info").json()
        st = info["internal_states"][0]
        if st["num_running_reqs"] == 0 and st["num_queue_reqs"] == 0 and st["kv_used_pages"] == 0:
            return info
        assert time.time() < deadline, f"server not idle: {st}"
        time.sleep(0.05)


GREEDY = {"temperature": 0}
NOEOS = {"ignore_eos": True}


# -- basics ----------------------------------------------------------------------------------------

def test_health_models_server_info(server, client):
    assert _get(server, "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    info = _get(server, "/server_info").json()
    assert info["max_running_requests"] == MAX_RUNNING and info["max_model_len"] == MAX_MODEL_LEN
    assert info["memory_usage"]["token_capacity"] > 0 and info["speculative_algorithm"] == "NONE"


def test_completion_stream_equals_nonstream_and_usage(server, client):
    prompt = "def hello(world):"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, **GREEDY, extra_body=NOEOS)
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(server.tokenizer.encode(prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 10, n_prompt + 10)
    g = httpx.post(server.base + "/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}},
                   timeout=30, trust_env=False).json()
    assert g["text"] == r.choices[0].text and len(g["output_ids"]) == 10
    assert g["meta_info"]["completion_tokens"] == 10 and g["meta_info"]["prompt_tokens"] == n_prompt
    assert g["meta_info"]["finish_reason"] == {"type": "length"}
    assert server.tokenizer.decode(g["output_ids"]) == g["text"]

    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=10, stream=True, **GREEDY,
                                            extra_body=NOEOS, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == n_prompt

    # /generate streaming: cumulative text, last chunk has the finish reason
    with httpx.stream("POST", server.base + "/generate", json={"input_ids": g["output_ids"][:3], "stream": True,
                      "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}, timeout=30, trust_env=False) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length"} and len(events[-1]["output_ids"]) == 5


def test_chat_stream_and_nonstream(server, client):
    from serving.chat import plain_template

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "print the list"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, **GREEDY, extra_body=NOEOS)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(server.tokenizer.encode(plain_template(messages)))
    assert r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True, **GREEDY,
                                                 extra_body=NOEOS, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    # seeded sampling is reproducible
    a, b = (client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=1.0, top_p=0.9,
                                           seed=7).choices[0].message.content for _ in range(2))
    assert a == b


def test_stop_strings(server, client):
    prompt = "class Foo:"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, **GREEDY, extra_body=NOEOS).choices[0].text
    printable = [i for i in range(4, len(full) - 2) if full[i:i + 2].isprintable() and "\ufffd" not in full[i:i + 2]]
    if not printable:
        pytest.skip(f"greedy text has no printable 2-char window: {full!r}")
    stop = full[printable[0]:printable[0] + 2]
    want = full[: full.find(stop)]
    for stops in (stop, [stop, "\u2603never"]):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, stop=stops, **GREEDY, extra_body=NOEOS)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, stop=stops, stream=True,
                                                **GREEDY, extra_body=NOEOS))
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "stop"


# -- n, best_of, echo, batched prompts -------------------------------------------------------------

SAMPLED = {"temperature": 1.0, "top_p": 0.95}


def _stream_texts(chunks, field="text") -> tuple[dict, dict]:
    """OpenAI stream chunks -> ({index: text}, {index: finish_reason})."""
    texts, finish = {}, {}
    for c in chunks:
        for ch in c.choices:
            piece = ch.text if field == "text" else (ch.delta.content or "")
            texts[ch.index] = texts.get(ch.index, "") + piece
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    return texts, finish


def test_n_with_a_seed_equals_single_requests_with_seeds_seed_and_up(server, client):
    prompt, seed, n = "def sample(x):", 11, 3
    kw = dict(model="tiny", max_tokens=8, **SAMPLED, extra_body=NOEOS)
    singles = [client.completions.create(prompt=prompt, seed=seed + j, **kw).choices[0].text for j in range(n)]
    assert len(set(singles)) > 1, singles  # different seeds sample differently
    r = client.completions.create(prompt=prompt, n=n, seed=seed, user="tester-1", **kw)
    assert [c.index for c in r.choices] == list(range(n)) and [c.text for c in r.choices] == singles
    n_prompt = len(server.tokenizer.encode(prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n * 8)  # the prompt counted once
    assert [c.text for c in client.completions.create(prompt=prompt, n=n, best_of=n, seed=seed, **kw).choices] == singles
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        client.completions.create(prompt=prompt, n=2, best_of=3, stream=True, **kw)
    # streaming: the choices' chunks interleave, each names its index; usage covers them all
    chunks = list(client.completions.create(prompt=prompt, n=n, seed=seed, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    texts, finish = _stream_texts(chunks)
    assert [texts[j] for j in range(n)] == singles and set(finish.values()) == {"length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n * 8
    # chat
    msgs = [{"role": "user", "content": "write a loop"}]
    ckw = dict(model="tiny", messages=msgs, max_tokens=6, **SAMPLED, extra_body=NOEOS)
    chat_singles = [client.chat.completions.create(seed=seed + j, **ckw).choices[0].message.content for j in range(2)]
    rc = client.chat.completions.create(n=2, seed=seed, user="tester-2", **ckw)
    assert [c.message.content for c in rc.choices] == chat_singles and [c.index for c in rc.choices] == [0, 1]
    chunks = list(client.chat.completions.create(n=2, seed=seed, stream=True, **ckw))
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant") == [0, 1]
    texts, _ = _stream_texts(chunks, field="delta")
    assert [texts[0], texts[1]] == chat_singles
    # /generate: n > 1 answers a list
    sp = {"max_new_tokens": 8, **SAMPLED, **NOEOS}
    gen = lambda body: httpx.post(server.base + "/generate", json=body, timeout=60, trust_env=False).json()
    g_singles = [gen({"text": prompt, "sampling_params": {**sp, "seed": seed + j}})["text"] for j in range(n)]
    assert g_singles == singles
    g = gen({"text": prompt, "sampling_params": {**sp, "seed": seed, "n": n}})
    assert [x["text"] for x in g] == singles and len({x["meta_info"]["id"] for x in g}) == n
    _wait_idle(server)


# -- logprobs, penalties, logit_bias, min_tokens, best_of ------------------------------------------

def _gen(server, body):
    r = httpx.post(server.base + "/generate", json=body, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def test_logprobs_on_every_endpoint_agree_and_are_log_softmax_values(server, client):
    prompt, k = "def f(x):", 3
    kw = dict(model="tiny", prompt=prompt, max_tokens=6, **GREEDY, extra_body=NOEOS)
    plain = client.completions.create(**kw).choices[0].text
    c = client.completions.create(logprobs=k, **kw).choices[0]
    assert c.text == plain  # asking for logprobs changes nothing
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= k + 1  # the top k and the chosen token (equal texts merge)
        assert max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy: the chosen token is the top 1
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
    # /generate: SGLang's [logprob, id, None]; the same values, the top 1 is the chosen id
    g = _gen(server, {"text": prompt, "return_logprob": True, "top_logprobs_num": k,
                      "sampling_params": {"max_new_tokens": 6, **GREEDY, **NOEOS}})
    out = g["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in out] == g["output_ids"] and all(x is None for *_, x in out)
    assert [v for v, _, _ in out] == pytest.approx(lp.token_logprobs, abs=1e-6)
    tops = g["meta_info"]["output_top_logprobs"]
    assert [len(t) for t in tops] == [k] * 6 and [t[0][1] for t in tops] == g["output_ids"]
    assert all(a[0] >= b[0] for t in tops for a, b in zip(t, t[1:]))  # most likely first
    assert [t[0][0] for t in tops] == pytest.approx([v for v, _, _ in out], abs=1e-6)
    # streaming: each chunk carries its own tokens' logprobs, which add up to the whole
    chunks = list(client.completions.create(logprobs=k, stream=True, **kw))
    got = [x for ch in chunks for c_ in ch.choices if c_.logprobs for x in c_.logprobs.token_logprobs]
    offs = [x for ch in chunks for c_ in ch.choices if c_.logprobs for x in c_.logprobs.text_offset]
    assert got == pytest.approx(lp.token_logprobs, abs=1e-6) and offs == lp.text_offset
    # chat: choices[].logprobs.content[] of {token, logprob, bytes, top_logprobs}
    ckw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, **GREEDY, extra_body=NOEOS)
    rc = client.chat.completions.create(logprobs=True, top_logprobs=2, **ckw)
    content = rc.choices[0].logprobs.content
    assert len(content) == rc.usage.completion_tokens == 5
    for e in content:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6) and e.top_logprobs[0].token == e.token
    assert client.chat.completions.create(**ckw).choices[0].logprobs is None
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **ckw))
    streamed = [e for ch in chunks for c_ in ch.choices if c_.logprobs for e in c_.logprobs.content]
    # (equal up to float rounding: a step may run padded on a wider shape while its own compiles)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    _wait_idle(server)


def test_logit_bias_min_tokens_and_penalties_change_the_output(server, client):
    prompt = "x = [1, 2"
    ids = lambda **sp: _gen(server, {"text": prompt, "sampling_params": {"max_new_tokens": 8, **GREEDY, **NOEOS, **sp}})[
        "output_ids"]
    base = ids()
    # logit_bias +100 forces a token, -100 forbids one; the OpenAI endpoints do the same
    forced = next(t for t in range(300, 400) if t not in base)
    assert ids(logit_bias={str(forced): 100}) == [forced] * 8
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, logit_bias={str(forced): 100}, **GREEDY,
                                  extra_body=NOEOS)
    assert r.choices[0].text == server.tokenizer.decode([forced] * 8)
    assert ids(logit_bias={str(base[0]): -100})[0] != base[0]
    # min_tokens: a stop id that would end the request at once is masked for min_tokens tokens
    stop = {"stop_token_ids": [base[0]]}
    assert ids(**stop) == base[:1]
    held = ids(**stop, min_new_tokens=4)
    assert len(held) >= 4 and base[0] not in held[:4]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, **GREEDY,
                                  extra_body={**NOEOS, **stop, "min_tokens": 4})
    assert r.choices[0].text == server.tokenizer.decode(held) and r.usage.completion_tokens == len(held)
    # penalties: a greedy run that repeats a token repeats less; every endpoint gives the same tokens
    pen = {"presence_penalty": 2.0, "frequency_penalty": 2.0, "repetition_penalty": 5.0}
    penalized = ids(**pen)
    if len(set(base)) < len(base):
        assert penalized != base
    assert len(set(penalized)) >= len(set(base))
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, presence_penalty=2.0,
                                  frequency_penalty=2.0, **GREEDY, extra_body={**NOEOS, "repetition_penalty": 5.0})
    assert r.choices[0].text == server.tokenizer.decode(penalized)
    _wait_idle(server)


def test_processed_requests_equal_engine_generate(server, model_dir):
    """The server's tokens and logprobs for penalties, logit_bias, min_tokens and logprobs equal
    Engine.generate's for the same SamplingParams (a second engine over the same weights)."""
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.sampling import SamplingParams

    prompt, forced = "while x <", 333
    stop_id = _gen(server, {"text": prompt, "sampling_params": {"max_new_tokens": 1, **GREEDY}})["output_ids"][0]
    cases = [  # (/generate sampling_params, top-level fields, SamplingParams)
        ({"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
         {"return_logprob": True, "top_logprobs_num": 2},
         SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, logprobs=2)),
        ({"logit_bias": {str(forced): 8.0, str(stop_id): -100}}, {},
         SamplingParams(logit_bias={forced: 8.0, stop_id: -100.0})),
        ({"stop_token_ids": [stop_id], "min_new_tokens": 3}, {"return_logprob": True},
         SamplingParams(stop_token_ids=(stop_id,), min_tokens=3, logprobs=0)),
        ({"temperature": 1.0, "seed": 7, "frequency_penalty": 1.0}, {"return_logprob": True, "top_logprobs_num": 4},
         SamplingParams(temperature=1.0, seed=7, frequency_penalty=1.0, logprobs=4)),
    ]
    served = []
    for sp, top, _ in cases:
        body = {"text": prompt, **top, "sampling_params": {"max_new_tokens": 7, "ignore_eos": True, **GREEDY, **sp}}
        served.append(_gen(server, body))
    engine = Engine.from_pretrained(model_dir, EngineConfig(max_running_requests=MAX_RUNNING, max_prefill_tokens=256,
                                                            max_model_len=MAX_MODEL_LEN, precompile=False))
    results = engine.generate([prompt] * len(cases),
                              [dataclasses.replace(p, max_new_tokens=7, ignore_eos=True) for *_, p in cases])
    for (sp, top, _), g, r in zip(cases, served, results):
        assert g["output_ids"] == r.token_ids, sp
        if top.get("return_logprob"):
            assert [v for v, _, _ in g["meta_info"]["output_token_logprobs"]] == pytest.approx(r.logprobs, abs=1e-4)
            assert [[a for _, a, _ in t] for t in g["meta_info"]["output_top_logprobs"]] == \
                [[a for a, _ in t] for t in r.top_logprobs]
    assert stop_id not in results[1].token_ids  # biased -100
    assert stop_id not in results[2].token_ids[:3] and len(results[2].token_ids) >= 3


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(server, client):
    prompt, seed, best_of, n = "def sample(x):", 21, 4, 2
    kw = dict(model="tiny", prompt=prompt, max_tokens=6, logprobs=0, **SAMPLED, extra_body=NOEOS)
    singles = [client.completions.create(seed=seed + j, **kw).choices[0] for j in range(best_of)]
    ranked = sorted(singles, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)[:n]
    r = client.completions.create(n=n, best_of=best_of, seed=seed, **kw)
    assert [c.index for c in r.choices] == list(range(n)) and [c.text for c in r.choices] == [c.text for c in ranked]
    assert r.usage.completion_tokens == best_of * 6  # every candidate was generated
    r = client.completions.create(n=n, best_of=best_of, seed=seed, **{**kw, "logprobs": None})
    assert [c.text for c in r.choices] == [c.text for c in ranked] and r.choices[0].logprobs is None
    _wait_idle(server)


def test_logit_processors_off_refuses_their_parameters(server, client, monkeypatch):
    # what ServerState.limits() says of an engine built with logit_processors="off" (engine.processors None);
    # the live engine itself is left alone
    limits = server.state.limits
    assert limits().logit_processors and server.state.engine.processors is not None
    monkeypatch.setattr(server.state, "limits", lambda: dataclasses.replace(limits(), logit_processors=False))
    for make, named in ((lambda: client.completions.create(model="tiny", prompt="hi", logprobs=1), "logprobs"),
                        (lambda: client.completions.create(model="tiny", prompt="hi", logit_bias={"5": 1}),
                         "logit_bias"),
                        (lambda: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "h"}],
                                                                frequency_penalty=1), "frequency_penalty")):
        with pytest.raises(openai.BadRequestError, match="logit-processors off") as e:
            make()
        assert e.value.response.json()["error"]["param"] == named
    r = httpx.post(server.base + "/generate", json={"text": "hi", "return_logprob": True}, timeout=30, trust_env=False)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_logprob"
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2, presence_penalty=0).choices


def test_batched_prompts_and_echo(server, client):
    prompts = ["import os", "class A(B):", "x = [1, 2"]
    ids = [server.tokenizer.encode(p) for p in prompts]
    kw = dict(model="tiny", max_tokens=6, **GREEDY, extra_body=NOEOS)
    singles = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    for batch in (prompts, ids):  # strings, or lists of token ids
        r = client.completions.create(prompt=batch, n=2, user="u", **kw)
        assert [c.index for c in r.choices] == list(range(6))  # prompt-major
        assert [c.text for c in r.choices] == [t for t in singles for _ in range(2)]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (sum(map(len, ids)), 6 * 6)
    # seeded sampling: every prompt of a batch uses seed, seed + 1, ... like single requests
    skw = dict(model="tiny", max_tokens=6, seed=3, **SAMPLED, extra_body=NOEOS)
    want = [client.completions.create(prompt=p, **{**skw, "seed": 3 + j}).choices[0].text for p in prompts[:2]
            for j in range(2)]
    assert [c.text for c in client.completions.create(prompt=prompts[:2], n=2, **skw).choices] == want
    # echo: the prompt text first (token-id prompts are decoded), in the body and as each stream's first chunk
    r = client.completions.create(prompt=prompts, echo=True, **kw)
    assert [c.text for c in r.choices] == [p + t for p, t in zip(prompts, singles)]
    r = client.completions.create(prompt=ids[1], echo=True, **kw)
    assert r.choices[0].text == server.tokenizer.decode(ids[1]) + singles[1]
    chunks = list(client.completions.create(prompt=prompts, echo=True, stream=True, **kw))
    assert [c.choices[0].text for c in chunks[:3]] == prompts and [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]
    texts, finish = _stream_texts(chunks)
    assert [texts[i] for i in range(3)] == [p + t for p, t in zip(prompts, singles)] and set(finish.values()) == {"length"}
    # /generate batches: a list in, a list out; stream chunks name their index
    sp = {"max_new_tokens": 6, **GREEDY, **NOEOS}
    g = httpx.post(server.base + "/generate", json={"text": prompts, "sampling_params": sp}, timeout=60,
                   trust_env=False).json()
    assert [x["text"] for x in g] == singles and [x["meta_info"]["prompt_tokens"] for x in g] == list(map(len, ids))
    with httpx.stream("POST", server.base + "/generate", json={"input_ids": ids, "stream": True,
                      "sampling_params": {**sp, "n": 2}}, timeout=60, trust_env=False) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    last = {e["index"]: e for e in events}
    assert sorted(last) == list(range(6)) and [last[i]["text"] for i in range(6)] == [t for t in singles for _ in range(2)]
    assert all(last[i]["meta_info"]["finish_reason"] == {"type": "length"} for i in range(6))
    _wait_idle(server)


def test_a_client_leaving_a_stream_of_several_choices_aborts_them_all(server, monkeypatch):
    _wait_idle(server)
    key = ("dspark:requests_total", (("finish_reason", "abort"),))
    aborted0 = _metrics(server).get(key, 0)
    body = {"prompt": ["while True:", "for x in y:"], "n": 2, "max_tokens": 2000, **GREEDY, **NOEOS, "stream": True}
    with httpx.Client(trust_env=False, timeout=30) as c:
        with c.stream("POST", server.base + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            got, lines = 0, resp.iter_lines()
            for line in lines:
                got += line.startswith("data: {")
                if got >= 6:
                    break
            assert _get(server, "/server_info").json()["internal_states"][0]["num_running_reqs"] == 4
    _wait_idle(server)
    assert _metrics(server)[key] - aborted0 == 4
    # one prompt of a batch over the context: a 400 naming it, before anything is queued
    r = httpx.post(server.base + "/v1/completions", json={"prompt": ["a", "hi " * 3000], "max_tokens": 4},
                   timeout=30, trust_env=False)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("'prompt[1]': "), r.text
    # the engine refusing one choice refuses the request, and the choices it had taken are aborted
    from dspark_jax.errors import InvalidRequestError

    engine, refused = server.state.engine, server.tokenizer.encode("refuse me")
    real_add = engine.add_request

    def add_request(prompt, params, request_id=None):
        if list(prompt) == refused:
            raise InvalidRequestError("injected refusal")
        return real_add(prompt, params, request_id=request_id)

    monkeypatch.setattr(engine, "add_request", add_request)
    r = httpx.post(server.base + "/v1/completions", json={**body, "prompt": ["while True:", "refuse me"],
                                                          "stream": True}, timeout=30, trust_env=False)
    assert r.status_code == 400 and "injected refusal" in r.json()["error"]["message"], r.text
    info = _wait_idle(server)
    assert _metrics(server)[key] - aborted0 == 6  # the two choices of the first prompt
    assert info["internal_states"][0]["free_slots"] == info["internal_states"][0]["total_slots"] == MAX_RUNNING


# -- concurrency -----------------------------------------------------------------------------------

N_CONCURRENT = 64


def test_concurrent_streams_match_solo_runs(server, client):
    prompts = [f"x = {i} * {i % 7} + foo(bar{i})" for i in range(N_CONCURRENT)]
    max_tokens = [6 + i % 7 for i in range(N_CONCURRENT)]
    solo = [client.completions.create(model="tiny", prompt=p, max_tokens=m, **GREEDY, extra_body=NOEOS).choices[0].text
            for p, m in zip(prompts, max_tokens)]

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120,
                                      http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=N_CONCURRENT + 4),
                                                                    trust_env=False, timeout=120)) as ac:
            async def one(p, m):
                s = await ac.completions.create(model="tiny", prompt=p, max_tokens=m, stream=True, **GREEDY,
                                                extra_body=NOEOS, stream_options={"include_usage": True})
                text, usage, finish = "", None, None
                async for c in s:
                    if c.choices:
                        text += c.choices[0].text
                        finish = c.choices[0].finish_reason or finish
                    if c.usage:
                        usage = c.usage
                return text, usage.completion_tokens, finish

            return await asyncio.wait_for(asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens))), 90)

    before = _metrics(server)
    out = asyncio.run(run_all())
    assert [o[0] for o in out] == solo
    assert [o[1] for o in out] == max_tokens and all(o[2] == "length" for o in out)
    _wait_idle(server)
    after = _metrics(server)
    gen = ("dspark:generation_tokens_total", ())
    assert after[gen] - before[gen] == sum(max_tokens)


# -- cancellation ----------------------------------------------------------------------------------

def test_client_disconnect_frees_slot_and_pages(server):
    _wait_idle(server)
    key = ("dspark:requests_total", (("finish_reason", "abort"),))
    aborted0 = _metrics(server).get(key, 0)
    body = {"prompt": "while True:", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(trust_env=False, timeout=30) as c:
        for _ in range(2):  # twice, to be sure the slot is reusable
            with c.stream("POST", server.base + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                got = 0
                lines = resp.iter_lines()  # kept: breaking out of a bare resp.iter_lines() closes the response
                for line in lines:
                    got += line.startswith("data: {")
                    if got >= 2:
                        break
                mid = _get(server, "/server_info").json()["internal_states"][0]
                assert mid["kv_used_pages"] > 0 and mid["num_running_reqs"] == 1
            # leaving the block closes the connection mid-stream
            info = _wait_idle(server)
            assert info["memory_usage"]["kv_used_pages"] == 0
    # non-streaming: a client that times out is aborted too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base + "/v1/completions", json={**body, "stream": False}, timeout=0.3, trust_env=False)
    _wait_idle(server)
    assert _metrics(server)[key] - aborted0 == 3


# -- bad input -------------------------------------------------------------------------------------

BAD = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 4', 400, None),  # malformed JSON
    ("/v1/completions", b'{"prompt": "\xff\xfe hi"}', 400, None),  # invalid UTF-8
    ("/v1/completions", b'[1, 2]', 400, None),  # not an object
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi " * 3000}, 400, "prompt"),  # longer than the context
    ("/v1/completions", {"prompt": [1, 2, 10**7]}, 400, None),  # token id outside the vocabulary
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "hi " * 3000]}, 400, "prompt"),  # one prompt of a batch too long
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/generate", {"sampling_params": {}}, 400, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, 400, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": []}, 400, "sampling_params"),
    ("/v1/nothing", {"prompt": "hi"}, 404, None),
]


def test_bad_inputs_get_4xx_and_server_carries_on(server, client):
    errs0 = sum(v for (n, _), v in _metrics(server).items() if n == "dspark:http_errors_total")
    with httpx.Client(trust_env=False, timeout=30) as c:
        # a long request keeps running while the bad ones arrive
        with c.stream("POST", server.base + "/v1/completions",
                      json={"prompt": "for i in", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}) as long:
            for path, body, status, param in BAD:
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = c.post(server.base + path, headers={"content-type": "application/json"}, **kw)
                assert r.status_code == status, (path, body, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], err
                if param:
                    assert err["param"] == param, (body, err)
                assert c.get(server.base + "/health").status_code == 200
            chunks = [json.loads(line[6:]) for line in long.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=3, **GREEDY, extra_body=NOEOS)
    assert r.usage.completion_tokens == 3
    errs1 = sum(v for (n, _), v in _metrics(server).items() if n == "dspark:http_errors_total")
    assert errs1 - errs0 == len(BAD) + 2


# -- metrics ---------------------------------------------------------------------------------------

def test_metrics_parse_and_move(server, client):
    before = _metrics(server)
    for name in ("dspark:num_running_reqs", "dspark:num_queue_reqs", "dspark:kv_pool_usage", "dspark:gen_throughput",
                 "dspark:step_time_seconds_count", "dspark:prompt_tokens_total", "dspark:generation_tokens_total"):
        assert (name, ()) in before, name
    client.completions.create(model="tiny", prompt="import os", max_tokens=5, **GREEDY, extra_body=NOEOS)
    _wait_idle(server)
    after = _metrics(server)
    key = ("dspark:requests_total", (("finish_reason", "length"),))
    assert after[key] == before.get(key, 0) + 1
    assert after[("dspark:generation_tokens_total", ())] - before[("dspark:generation_tokens_total", ())] == 5
    assert after[("dspark:prompt_tokens_total", ())] - before[("dspark:prompt_tokens_total", ())] == len(server.tokenizer.encode("import os"))
    assert after[("dspark:step_time_seconds_count", ())] > before[("dspark:step_time_seconds_count", ())]
    assert after[("dspark:kv_pool_usage", ())] == 0.0


# -- units -----------------------------------------------------------------------------------------

def test_text_deltas_hold_back_stop_prefixes():
    from serving.responses import TextDeltas

    d = TextDeltas(["END"])
    assert d.update("abc") == "abc"
    assert d.update("abcE") == ""  # might become "END"
    assert d.update("abcEN") == ""
    assert d.update("abcENx") == "ENx"
    assert d.final("abcENx") == ""
    d = TextDeltas(["END"])
    assert d.update("abE") == "ab"
    assert d.final("ab") == ""  # the engine cut "END..."


def test_chat_template_rendering():
    from serving.chat import ChatTemplateError, plain_template, render_chat

    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(msgs, None) == plain_template(msgs) == "user: hi\nassistant:"
    tpl = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert render_chat(msgs, tpl) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ChatTemplateError):
        render_chat(msgs, "{{ raise_exception('no system role') }}")


# -- launch CLI + SIGTERM --------------------------------------------------------------------------

def test_launch_cli_and_graceful_sigterm(model_dir, tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    # DSPARK without a drafter is a clear start-up error
    bad = subprocess.run([sys.executable, "-m", "serving.launch", "--model-path", str(model_dir), "--speculative-algorithm", "DSPARK"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "drafter" in bad.stderr
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "serving.launch", "--model-path", str(model_dir), "--port", str(port),
                             "--max-running-requests", "4", "--max-model-len", "512", "--max-total-tokens", "2048",
                             "--shutdown-timeout", "1", "--log-level", "warning", "--no-precompile"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(base + "/health", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "server did not become healthy"
            time.sleep(0.2)
        assert httpx.get(base + "/server_info", trust_env=False).json()["memory_usage"]["token_capacity"] == 2048
        body = {"prompt": "x", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
        finish = None
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30, trust_env=False) as resp:
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            proc.send_signal(signal.SIGTERM)
            for line in lines:
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        assert finish in ("length", "abort")  # finished in time, or ended with a clear reason
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_startup_progress_and_quiet_backends(monkeypatch):
    """compile_engines reports (0, total, None), then each executable; launch summarizes the work and
    drops JAX's notes about platforms nobody asked for, keeping everything else."""
    import logging
    import os

    from dspark_jax.engine.engine import compile_engines
    from serving import launch

    labels = [f"plain decode tokens={t}" for t in (1, 2, 4)] + ["plain prefill tokens=16"]

    class Engine:
        executables = staticmethod(lambda: [(lb, lambda: None) for lb in labels])
        widest_first = False

        class runner:
            take_compile_spans = staticmethod(list)

    calls = []
    compile_engines([Engine], lambda *a: calls.append(a))
    assert calls[0] == (0, 4, None) and [c[:2] for c in calls[1:]] == [(i, 4) for i in (1, 2, 3, 4)]
    assert sorted(c[2] for c in calls[1:]) == sorted(labels)
    assert launch.CompileProgress(Engine, bar=False).what == "3 plain decode, 1 plain prefill"

    record = lambda msg: logging.LogRecord("jax._src.xla_bridge", logging.INFO, "", 0, msg, None, None)
    tpu = record("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert not launch._requested_backend_or_other(tpu)
    assert launch._requested_backend_or_other(record("An NVIDIA GPU may be present on this machine"))
    monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")  # asked for, so its failure is news
    assert launch._requested_backend_or_other(tpu)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    launch.quiet_backend_noise()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"  # XLA errors still print
    logging.getLogger("jax._src.xla_bridge").removeFilter(launch._requested_backend_or_other)


# -- speculative (DSpark) server -------------------------------------------------------------------

def test_speculative_server_reports_spec_stats(tmp_path_factory):
    from dspark_jax.checkpoint import load_model
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.sampling import SamplingParams
    from dspark_jax.spec.config import SpeculativeConfig
    from dspark_jax.tiny_model import write_tiny_model
    from dspark_jax.tokenizer import Tokenizer
    from serving.app import ServerConfig, create_app
    from tests.test_speculative_engine import repeat_biased_drafter

    d = write_tiny_model(tmp_path_factory.mktemp("spec-srv") / "m", vocab_size=300, max_position_embeddings=512)
    _, target = load_model(d)
    # Lazy compilation: only the shapes this test touches (keeps the cold-cache time down).
    ec = EngineConfig(max_running_requests=4, max_prefill_tokens=64, max_model_len=256, page_size=8, precompile=False)
    engine = Engine(target, Tokenizer.from_folder(d), ec, drafter=repeat_biased_drafter(target),
                    spec=SpeculativeConfig(mode="cap-accept"))
    ids = [5, 17, 42, 9, 77]
    want = Engine.from_pretrained(d, ec).generate(ids, SamplingParams(
        max_new_tokens=24, ignore_eos=True))[0].token_ids
    app = create_app(engine, ServerConfig(model_name="m", speculative_algorithm="DSPARK", verify_mode="cap-accept",
                                          block_size=engine.worker.gamma))
    with serve_in_thread(app) as base:
        g = httpx.post(base + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                       "ignore_eos": True}}, timeout=60, trust_env=False).json()
        assert g["output_ids"] == want  # lossless at temperature 0
        mi = g["meta_info"]
        assert mi["spec_verify_ct"] >= 1 and mi["completion_tokens"] == 24
        assert sum(mi["spec_accept_lens"]) + 1 >= 24 and mi["spec_accept_length"] >= 1
        assert mi["spec_block_accept_length"] >= mi["spec_accept_length"] - 1e-9
        with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as c:
            r = c.completions.create(model="m", prompt=ids, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True, "return_spec_tokens_details": True})
        assert r.model_extra["sglext"]["spec_tokens_details"]["spec_verify_ct"] == mi["spec_verify_ct"]
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(base + "/metrics", trust_env=False).text)}
        assert [s.value for s in fams["dspark:spec_accept_length"].samples][0] >= 1
        assert [s.value for s in fams["dspark:spec_verify_calls"].samples if s.name.endswith("_total")][0] >= 2 * mi["spec_verify_ct"] - 1
        total = lambda name: [s.value for s in fams[name].samples if s.name.endswith("_total")][0]
        # the counters sum what the two requests so far report for their own rows
        details = r.model_extra["sglext"]["spec_tokens_details"]
        assert total("dspark:spec_accepted_tokens") == sum(mi["spec_accept_lens"]) + sum(details["spec_accept_lens"])
        windows = lambda hist: sum(w * n for w, n in enumerate(hist))
        assert total("dspark:spec_verify_tokens") == (windows(mi["spec_cap_lens_histogram"])
                                                      + windows(details["spec_cap_lens_histogram"]))
        info = httpx.get(base + "/server_info", trust_env=False).json()
        assert info["internal_states"][0]["avg_spec_accept_length"] >= 1


# -- load generator --------------------------------------------------------------------------------

def test_load_generator_smoke(server, tmp_path, capsys):
    from benchmarks.load_generator import check_loopback, main

    out = tmp_path / "load.json"
    rc = main(["--base-url", server.base, "--num-requests", "12", "--concurrency", "6", "--max-tokens", "8",
               "--duration", "30", "--grace", "30", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["requests_ok"] == 12 and rep["output_tokens"] == 12 * 8
    assert rep["ttft_ms"]["p50"] > 0 and rep["itl_ms"]["p90"] >= rep["itl_ms"]["p50"] > 0
    assert "ttft_ms" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        check_loopback("http://example.com:30000")


@pytest.mark.slow
def test_soak_smoke_against_the_embedded_model(tmp_path):
    """benchmarks/soak.py for a few seconds: the embedded pair in its own server process (compiled
    lazily, small shapes), a handful of clients of every kind, bad requests and disconnects among
    them; no failure, and the server idle (no requests, pages or slots held) and cleanly stopped."""
    from benchmarks.soak import main

    rc = main(["--streams", "4", "--duration-s", "8", "--grace-s", "40", "--idle-timeout-s", "30", "--max-tokens", "12",
               "--bad-rate", "0.3", "--disconnect-rate", "0.2", "--no-progress", "--out", str(tmp_path), "--name", "ci",
               "--server-args", "--no-precompile --max-running-requests 4 --max-model-len 512 --max-prefill-tokens 64 "
               "--sps-table-path none"])
    rep = json.loads((tmp_path / "ci.json").read_text())
    assert rep["failures"] == 0, rep["failure_samples"]
    assert rep["idle_at_end"]["idle"] and rep["idle_at_end"]["free_slots"] == 4, rep["idle_at_end"]
    assert rc == 0 and rep["requests_ok"] >= 1 and rep["server_exit_code"] == 0
    assert rep["server"]["speculative_algorithm"] == "DSPARK" and rep["rss_mib"]["max"] > 0
    assert (tmp_path / "ci.md").read_text().startswith("# Soak") and (tmp_path / "ci.png").stat().st_size > 0


def test_speculative_server_concurrent_streams_and_disconnect(tmp_path_factory, monkeypatch):
    """The default serving path is speculative: 64 concurrent greedy streams through an overlapped
    compact-mode DSpark engine each equal plain greedy decoding of that prompt alone, and a client
    that disconnects mid-stream frees its slot and every KV page (target and draft caches share them)."""
    from dspark_jax.checkpoint import load_model
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.sampling import SamplingParams
    from dspark_jax.spec.config import SpeculativeConfig
    from dspark_jax.tiny_model import write_tiny_model
    from dspark_jax.tokenizer import Tokenizer
    from serving.app import ServerConfig, create_app
    from tests.test_speculative_engine import TABLE, repeat_biased_drafter

    d = write_tiny_model(tmp_path_factory.mktemp("spec-srv64") / "m", vocab_size=300, max_position_embeddings=512)
    _, target = load_model(d)
    ec = EngineConfig(max_running_requests=16, max_prefill_tokens=128, max_model_len=256, page_size=8, precompile=False)
    engine = Engine(target, Tokenizer.from_folder(d), ec, drafter=repeat_biased_drafter(target),
                    spec=SpeculativeConfig(mode="compact", cost_table=TABLE))
    assert engine.overlap
    prompts = [[5 + i % 50, 17 + i % 7, 42, 9 + i % 11] for i in range(N_CONCURRENT)]
    max_tokens = [6 + i % 9 for i in range(N_CONCURRENT)]
    plain = Engine.from_pretrained(d, ec)
    want = [plain.generate(p, SamplingParams(max_new_tokens=m, ignore_eos=True))[0].token_ids
            for p, m in zip(prompts, max_tokens)]
    app = create_app(engine, ServerConfig(model_name="m", speculative_algorithm="DSPARK", verify_mode="compact",
                                          block_size=engine.worker.gamma))
    with serve_in_thread(app) as base:
        class S:
            pass

        S.base = base

        async def run_all():
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=N_CONCURRENT + 4), trust_env=False,
                                         timeout=120) as ac:
                async def one(p, m):
                    ids = []
                    async with ac.stream("POST", base + "/generate", json={
                            "input_ids": p, "stream": True,
                            "sampling_params": {"max_new_tokens": m, "temperature": 0, "ignore_eos": True}}) as resp:
                        async for line in resp.aiter_lines():
                            if line.startswith("data: {"):
                                ids = json.loads(line[6:])["output_ids"]
                    return ids

                return await asyncio.wait_for(asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens))), 120)

        assert asyncio.run(run_all()) == want
        _wait_idle(S)
        # n choices through sampled compact rounds: each its own seed (compact's verify windows depend
        # on the batch, so a sampled choice need not equal the single request: see the static test)
        sp = {"max_new_tokens": 10, "temperature": 1.0, "top_k": 50, "ignore_eos": True}
        g = httpx.post(base + "/generate", json={"input_ids": prompts[:2], "sampling_params": {**sp, "seed": 21, "n": 3}},
                       timeout=60, trust_env=False).json()
        assert [len(x["output_ids"]) for x in g] == [10] * 6 and len({tuple(x["output_ids"]) for x in g}) > 1
        _wait_idle(S)
        # paced engine steps, so the 200 tokens (about 25 rounds) are still running when the client leaves
        real_step = engine.step
        monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.02), real_step())[1])
        body = {"input_ids": [7, 8, 9], "stream": True,
                "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
        with httpx.Client(trust_env=False, timeout=30) as c:
            with c.stream("POST", base + "/generate", json=body) as resp:
                got, lines = 0, resp.iter_lines()
                for line in lines:
                    got += line.startswith("data: {")
                    if got >= 2:
                        break
                assert _get(S, "/server_info").json()["internal_states"][0]["kv_used_pages"] > 0
        info = _wait_idle(S)
        assert info["memory_usage"]["kv_used_pages"] == 0 and engine.pool.num_free_pages == engine.pool.num_usable_pages


def test_n_with_a_seed_through_static_speculative_rounds(tmp_path_factory):
    """With a static DSpark engine a seeded sampled request gives the same tokens whatever shares its
    batch, so n choices with seed s (and a batch of prompts) equal single requests with seeds s, s+1, ..."""
    from dspark_jax.checkpoint import load_model
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.spec.config import SpeculativeConfig
    from dspark_jax.tiny_model import write_tiny_model
    from dspark_jax.tokenizer import Tokenizer
    from serving.app import ServerConfig, create_app
    from tests.test_speculative_engine import repeat_biased_drafter

    d = write_tiny_model(tmp_path_factory.mktemp("spec-srv-n") / "m", vocab_size=300, max_position_embeddings=512)
    _, target = load_model(d)
    ec = EngineConfig(max_running_requests=8, max_prefill_tokens=64, max_model_len=256, page_size=8, precompile=False)
    engine = Engine(target, Tokenizer.from_folder(d), ec, drafter=repeat_biased_drafter(target),
                    spec=SpeculativeConfig(mode="static"))
    app = create_app(engine, ServerConfig(model_name="m", speculative_algorithm="DSPARK", verify_mode="static",
                                          block_size=engine.worker.gamma))
    prompts = [[5, 17, 42, 9], [6, 18, 43]]
    sp = {"max_new_tokens": 10, "temperature": 1.0, "top_k": 50, "ignore_eos": True}
    with serve_in_thread(app) as base:
        gen = lambda body: httpx.post(base + "/generate", json=body, timeout=60, trust_env=False).json()
        singles = [gen({"input_ids": p, "sampling_params": {**sp, "seed": 21 + j}})["output_ids"]
                   for p in prompts for j in range(3)]
        assert len({tuple(x) for x in singles}) == 6
        one = gen({"input_ids": prompts[0], "sampling_params": {**sp, "seed": 21, "n": 3}})
        assert [x["output_ids"] for x in one] == singles[:3] and one[0]["meta_info"]["spec_verify_ct"] >= 1
        with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as c:
            r = c.completions.create(model="m", prompt=prompts, n=3, seed=21, max_tokens=10, temperature=1.0,
                                     extra_body={"top_k": 50, "ignore_eos": True})
        assert [engine.tokenizer.decode(x) for x in singles] == [c.text for c in r.choices]
        assert r.usage.completion_tokens == 60


def test_server_args_refuse_impossible_combinations():
    from dspark_jax.server_args import ServerArgs

    for kw, message in ((dict(speculative_algorithm="MTP", sps_min_gain=0.1), "DSpark options"),
                        (dict(sps_min_gain=-0.1), ">= 0"),
                        (dict(rounds_per_call=0), ">= 1"),
                        (dict(speculative_algorithm="MTP", rounds_per_call=2), "DSpark options"),
                        (dict(speculative_algorithm="DSPARK", max_running_requests=0), "--max-running-requests")):
        with pytest.raises(ValueError, match=message):
            ServerArgs(**kw).resolve()
    assert ServerArgs(sps_table_path="t.json").resolve().speculative_algorithm == "DSPARK"


# -- hostile input ---------------------------------------------------------------------------------

CHAT_HI = {"messages": [{"role": "user", "content": "hi"}]}
DEEP = 100_000


def _raw(s: str) -> bytes:
    return s.encode()


# (path, body: dict or raw bytes, param or None, a phrase the message must hold)
HOSTILE = [
    # lone UTF-16 surrogates: valid JSON, not valid Unicode
    ("/v1/completions", _raw('{"prompt": "hi \\ud800 there"}'), "prompt", "surrogate"),
    ("/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": "hi \\udfff"}]}'), "messages", "surrogate"),
    ("/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
     "messages", "surrogate"),
    ("/generate", _raw('{"text": "hi \\ud800 there"}'), "text", "surrogate"),
    ("/v1/completions", _raw('{"prompt": "hi", "stop": ["\\udbff"]}'), "stop", "surrogate"),
    ("/v1/completions", _raw('{"prompt": "hi", "model": "\\ud800"}'), "model", "surrogate"),
    ("/v1/completions", _raw('{"prompt": "hi", "\\ud800": 1}'), None, "surrogate"),
    # numbers and nesting
    ("/v1/completions", _raw('{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}"), None, "digits"),
    ("/v1/completions", _raw('{"prompt": [1, ' + "7" * 4400 + "]}"), None, "digits"),
    ("/v1/completions", _raw('{"prompt": "hi", "temperature": ' + "1" * 400 + "}"), None, "digits"),
    ("/v1/completions", _raw('{"prompt": "hi", "temperature": 1e400}'), "temperature", "finite"),
    ("/v1/completions", _raw('{"prompt": "hi", "temperature": NaN}'), None, "NaN"),
    ("/generate", _raw('{"text": "hi", "sampling_params": {"temperature": -Infinity}}'), None, "Infinity"),
    ("/v1/completions", _raw('{"prompt": "hi", "x": ' + "[" * DEEP + "]" * DEEP + "}"), None, "nested"),
    ("/v1/completions", _raw('{"prompt": "hi", "metadata": ' + "[" * 70 + "]" * 70 + "}"), None, "nested"),
    ("/v1/completions", _raw('{"prompt": "hi", "user": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}"), None, "nested"),
    # out of range for the device arrays
    ("/v1/completions", {"prompt": "hi", "top_k": 1099511627776}, "top_k", "less than"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k", "greater than"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 2**31}}, "top_k", "less than"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**32}, "seed", "less than"),
    ("/generate", {"text": "hi", "sampling_params": {"sampling_seed": -1}}, "sampling_seed", "greater than"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**70]}, "stop_token_ids", "[0, "),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-5]}, "stop_token_ids", "[0, "),
    ("/v1/chat/completions", {**CHAT_HI, "stop_token_ids": [10**7]}, "stop_token_ids", "[0, "),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [1, "2"]}}, "stop_token_ids", "integer"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(300))}, "stop_token_ids", "at most"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "greater than"),
    ("/v1/chat/completions", {**CHAT_HI, "max_completion_tokens": MAX_MODEL_LEN + 1}, "max_completion_tokens", "context"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**30}}, "max_new_tokens", "context"),
    ("/v1/completions", {"prompt": "hi", "temperature": True}, "temperature", "number"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3.0}, "max_tokens", "integer"),
    # stop strings
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16"),
    ("/v1/chat/completions", {**CHAT_HI, "stop": "x" * 257}, "stop", "at most 256"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["ok", "y" * 300_000]}}, "stop", "at most 256"),
    ("/v1/completions", {"prompt": "hi", "stop": [3]}, "stop", "list of strings"),
    # parameters this server does not implement
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of", ">= n"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix", "suffix"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs", "integer"),
    ("/v1/chat/completions", {**CHAT_HI, "top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ("/v1/chat/completions", {**CHAT_HI, "repetition_penalty": -1}, "repetition_penalty", "greater than 0"),
    ("/v1/chat/completions", {**CHAT_HI, "min_tokens": 5000}, "min_tokens", "min_tokens must be"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "min_p": 0.05}, "min_p", "min_p"),
    ("/v1/chat/completions", {**CHAT_HI, "response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ("/v1/chat/completions", {**CHAT_HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool"),
    ("/v1/chat/completions", {**CHAT_HI, "tool_choice": "auto"}, "tool_choice", "tool"),
    ("/v1/chat/completions", {**CHAT_HI, "functions": [{"name": "f"}]}, "functions", "function"),
    ("/v1/chat/completions", {**CHAT_HI, "function_call": "auto"}, "function_call", "function"),
    ("/v1/chat/completions", {**CHAT_HI, "parallel_tool_calls": True}, "parallel_tool_calls", "tool"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages", "tool_calls"),
    ("/v1/chat/completions", {**CHAT_HI, "store": True}, "store", "stored"),
    ("/v1/chat/completions", {**CHAT_HI, "regex": "a("}, "regex", "cannot compile"),
    ("/v1/completions", {"prompt": "hi", "json_schema": "{"}, "json_schema", "not valid JSON"),
    ("/v1/completions", {"prompt": "hi", "skip_special_tokens": False}, "skip_special_tokens", "special tokens"),
    ("/generate", {"text": "hi", "top_logprobs_num": 2}, "top_logprobs_num", "needs 'return_logprob'"),
    *[("/generate", {"text": "hi", "sampling_params": {k: v}}, k, k) for k, v in (
        ("min_p", 0.1), ("json_schema", '{"type": 5}'), ("regex", 5), ("ebnf", "root ::= 'a'"),
        ("structural_tag", "{}"), ("no_stop_trim", True), ("n", 0))],
    # unknown fields are named
    ("/v1/completions", {"prompt": "hi", "foo": 1, "bar": None}, "foo", "'foo', 'bar'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, "messages", "messages[0].mood"),
    ("/generate", {"text": "hi", "sampling_params": {"temprature": 0.5}}, "temprature", "sampling_params.temprature"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True, "x": 1}}, "stream_options", "x"),
    ("/generate", {"text": "hi", "rid": "abc"}, "rid", "rid"),
]


def _post(c, server, path, body):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    return c.post(server.base + path, headers={"content-type": "application/json"}, **kw)


def _reference_answers(c, server) -> list:
    """One greedy answer per endpoint, to compare before and after hostile input."""
    out = [_post(c, server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 6, **GREEDY, **NOEOS}).json()["choices"][0]["text"],
           _post(c, server, "/v1/chat/completions", {**CHAT_HI, "max_tokens": 6, **GREEDY, **NOEOS}).json()["choices"][0]["message"]["content"],
           _post(c, server, "/generate", {"text": "import", "sampling_params": {"max_new_tokens": 6, **GREEDY, **NOEOS}}).json()["output_ids"]]
    return out


def test_hostile_inputs_get_4xx_and_the_engine_carries_on(server):
    with httpx.Client(trust_env=False, timeout=60) as c:
        before = _reference_answers(c, server)
        with c.stream("POST", server.base + "/v1/completions",
                      json={"prompt": "for i in", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}) as long:
            for path, body, param, phrase in HOSTILE:
                r = _post(c, server, path, body)
                assert r.status_code == 400, (path, str(body)[:200], r.text[:300])
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
                assert phrase in err["message"], (phrase, err)
                if param:
                    assert err["param"] == param, (str(body)[:200], err)
            chunks = [json.loads(line[6:]) for line in long.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert c.get(server.base + "/health").json() == {"status": "ok"}
        assert _reference_answers(c, server) == before
        # neutral values of unimplemented parameters, and the ignored fields, change nothing
        neutral = {"user": "u-1", "safety_identifier": "s", "n": 1, "best_of": 1, "echo": False, "logprobs": None,
                   "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "min_tokens": 0, "min_p": 0,
                   "logit_bias": {}, "skip_special_tokens": True, "stop": None, "seed": None, "top_k": -1}
        r = _post(c, server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 6, **GREEDY, **NOEOS, **neutral})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == before[0], r.text
        chat_neutral = {"metadata": {"k": "v"}, "store": False, "tools": [], "tool_choice": "none", "logprobs": False,
                        "top_logprobs": 0, "response_format": {"type": "text"}, "user": "u-1"}
        r = _post(c, server, "/v1/chat/completions", {**CHAT_HI, "max_tokens": 6, **GREEDY, **NOEOS, **chat_neutral})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == before[1], r.text
        r = _post(c, server, "/generate", {"text": "import", "return_logprob": False, "sampling_params": {
            "max_new_tokens": 6, **GREEDY, **NOEOS, "repetition_penalty": 1.0, "min_new_tokens": 0, "regex": None}})
        assert r.status_code == 200 and r.json()["output_ids"] == before[2], r.text


def test_body_size_limit(server):
    """413 before reading a body whose Content-Length is too large, and while reading a chunked one."""
    cfg = server.state.cfg
    limit0, cfg.max_body_bytes = cfg.max_body_bytes, 64 << 10
    try:
        host, port = server.base.rsplit("//", 1)[1].split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:  # headers only: nothing more is sent
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 10000000\r\n\r\n")
            head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in head, head

        def chunks():
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"a" * 8192
            yield b'"}'

        with httpx.Client(trust_env=False, timeout=30) as c:
            for body in (chunks(), b'{"prompt": "hi", "pad": "' + b"b" * (100 << 10) + b'"}'):
                r = c.post(server.base + "/v1/completions", content=body, headers={"content-type": "application/json"})
                assert r.status_code == 413, r.text
                assert r.json()["error"]["code"] == "request_too_large" and "65536" in r.json()["error"]["message"]
                assert ("transfer-encoding" in r.request.headers) == (not isinstance(body, bytes))
            # a chunked body under the limit is fine
            r = c.post(server.base + "/v1/completions", content=iter([b'{"prompt": "hi", ', b'"max_tokens": 2}']),
                       headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    finally:
        cfg.max_body_bytes = limit0
    # the default limit refuses 10 MB (a prompt, an unknown field)
    for body in ({"prompt": "a" * 10_000_000}, {"prompt": "hi", "zzz": "b" * 10_000_000}):
        r = httpx.post(server.base + "/v1/completions", json=body, timeout=30, trust_env=False)
        assert r.status_code == 413, r.text[:200]
    assert _get(server, "/health").status_code == 200


def test_huge_prompt_is_tokenized_off_the_engine_thread(server, monkeypatch):
    """A 1 MiB prompt (under the body limit, over the context) is tokenized on the tokenize pool,
    never on the engine thread or the event loop, and refused with a 400 while a concurrent stream
    completes.  The engine thread only ever sees token ids."""
    engine, state = server.state.engine, server.state
    calls = []
    real = engine.encode_prompt

    def spy(prompt):
        calls.append((threading.current_thread(), prompt if isinstance(prompt, list) else len(prompt)))
        return real(prompt)

    monkeypatch.setattr(engine, "encode_prompt", spy)
    huge = "def f():" + " " * (1 << 20)
    with httpx.Client(trust_env=False, timeout=60) as c:
        with c.stream("POST", server.base + "/v1/completions",
                      json={"prompt": "while", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}) as s:
            r = c.post(server.base + "/v1/completions", json={"prompt": huge, "max_tokens": 4})
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "context" in r.json()["error"]["message"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    texts = [(t, n) for t, n in calls if not isinstance(n, list)]
    assert sorted(n for _, n in texts) == [len("while"), len(huge)], calls
    assert all(t is not state.loop.thread and t.name.startswith("dspark-tokenize") for t, _ in texts), calls
    assert all(t is state.loop.thread for t, n in calls if isinstance(n, list))  # the engine re-checks ids only


def test_chat_default_max_tokens(server, client, monkeypatch):
    """Chat without max_tokens gets ServerConfig.default_chat_max_tokens (1024 unless set)."""
    from serving.app import ServerConfig

    assert ServerConfig().default_chat_max_tokens == 1024
    monkeypatch.setattr(server.state.cfg, "default_chat_max_tokens", 5)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count"}], **GREEDY,
                                       extra_body=NOEOS)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_chat_default_max_tokens_is_capped_by_the_context_left(server, client, monkeypatch):
    """A default larger than the context left after the prompt is cut to what is left."""
    import dataclasses

    engine, cfg = server.state.engine, server.state.cfg
    seen = []
    real = engine.add_request

    def spy(prompt, params, request_id=None):  # record what the server asked for, then run 2 tokens of it
        seen.append((len(prompt), params.max_new_tokens))
        return real(prompt, dataclasses.replace(params, max_new_tokens=2), request_id=request_id)

    monkeypatch.setattr(engine, "add_request", spy)
    monkeypatch.setattr(cfg, "default_chat_max_tokens", 10**6)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **GREEDY)
    assert r.usage.completion_tokens <= 2
    assert seen == [(r.usage.prompt_tokens, MAX_MODEL_LEN - r.usage.prompt_tokens)]


def test_openapi_describes_request_bodies_and_405_keeps_allow(server):
    spec = _get(server, "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/generate", "GenerateRequest")):
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert "max_tokens" in schemas[model]["properties"] or "sampling_params" in schemas[model]["properties"]
    assert "ChatMessage" in schemas and "GenerateSamplingParams" in schemas
    r = _get(server, "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- engine faults ---------------------------------------------------------------------------------

def test_a_fault_in_one_request_fails_only_that_request(server, monkeypatch):
    """If handling one request's events raises on the engine thread (say its detokenization), that
    request gets a 500 naming the cause; the others, and later ones, are served as usual."""
    loop = server.state.loop
    victim_prompt = "def broken():"
    victim_ids = server.tokenizer.encode(victim_prompt)
    real_deliver, real_add = loop._deliver, server.state.engine.add_request

    def deliver(req, ids):
        if list(req.prompt_ids) == victim_ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenization fault")
        return real_deliver(req, ids)

    def add_request(prompt, params, request_id=None):
        if params.max_new_tokens == 7:
            raise KeyError("injected admission fault")
        return real_add(prompt, params, request_id=request_id)

    other = {"prompt": "import numpy", "max_tokens": 12, **GREEDY, **NOEOS}
    with httpx.Client(trust_env=False, timeout=60) as c:
        want = _post(c, server, "/v1/completions", other).json()["choices"][0]["text"]
        monkeypatch.setattr(loop, "_deliver", deliver)
        monkeypatch.setattr(server.state.engine, "add_request", add_request)
        with c.stream("POST", server.base + "/v1/completions", json={**other, "stream": True}) as s:
            bad = _post(c, server, "/v1/completions", {"prompt": victim_prompt, "max_tokens": 12, **GREEDY, **NOEOS})
            with c.stream("POST", server.base + "/generate", json={"text": victim_prompt, "stream": True,
                                                                 "sampling_params": {"max_new_tokens": 12}}) as bs:
                bad_stream = [json.loads(line[6:]) for line in bs.iter_lines() if line.startswith("data: {")]
            bad_add = _post(c, server, "/v1/chat/completions", {**CHAT_HI, "max_tokens": 7})
            got = "".join(json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines() if line.startswith("data: {"))
        assert got == want
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "internal_error"
        assert "UnicodeDecodeError" in bad.json()["error"]["message"] and "injected" in bad.json()["error"]["message"]
        assert "injected detokenization fault" in bad_stream[-1]["error"]["message"]
        assert bad_add.status_code == 500 and "KeyError" in bad_add.json()["error"]["message"]
        monkeypatch.undo()
        assert c.get(server.base + "/health").json() == {"status": "ok"}
        assert _post(c, server, "/v1/completions", other).json()["choices"][0]["text"] == want
    _wait_idle(server)


def test_engine_step_failure_fails_in_flight_requests_and_calls_on_fatal(model_dir):
    """engine.step() raising kills the engine: requests in flight get a 500 naming the cause, new
    ones a 503, /health a 503 with the cause, on_fatal fires once, and shutdown does not wait."""
    from dspark_jax.engine import Engine, EngineConfig
    from serving.app import ServerConfig, create_app

    engine = Engine.from_pretrained(model_dir, EngineConfig(max_running_requests=4, max_prefill_tokens=64,
                                                            max_model_len=256, precompile=False))

    def step():  # fail once two requests are in: no compilation is needed
        if len(engine.scheduler.waiting) + len(engine.scheduler.running) < 2:
            time.sleep(0.005)
            return []
        raise RuntimeError("injected device fault")

    engine.step = step
    fatal = []
    app = create_app(engine, ServerConfig(model_name="t", shutdown_timeout=30), on_fatal=fatal.append)
    state = app.state.server
    with serve_in_thread(app) as base:
        with httpx.Client(trust_env=False, timeout=30) as c:
            with c.stream("POST", base + "/v1/completions", json={"prompt": "a", "max_tokens": 5, "stream": True}) as s:
                assert s.status_code == 200
                r = c.post(base + "/generate", json={"text": "b", "sampling_params": {"max_new_tokens": 5}})
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            assert r.status_code == 500 and "injected device fault" in r.json()["error"]["message"], r.text
            assert "injected device fault" in events[-1]["error"]["message"] and events[-1]["error"]["code"] == 500
            assert state.fatal_event.wait(10) and fatal == [state.fatal_error] and "injected" in str(fatal[0])
            h = c.get(base + "/health")
            assert h.status_code == 503 and "injected device fault" in h.json()["error"]
            late = c.post(base + "/v1/completions", json={"prompt": "c", "max_tokens": 2})
            assert late.status_code == 503 and "injected device fault" in late.json()["error"]["message"]
        state.begin_drain()
        t0 = time.time()
    assert time.time() - t0 < 10
