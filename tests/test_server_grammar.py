"""Structured output over HTTP: response_format through the official openai client, /generate's regex
and json_schema, and the 400s of invalid, oversized or unsupported grammars."""

from __future__ import annotations

import json
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.conftest import write_hf_qwen3  # noqa: E402
from tests.test_server import serve_in_thread  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"]}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dspark_jax.engine import Engine, EngineConfig
    from serving.app import ServerConfig, create_app

    model_dir = write_hf_qwen3(tmp_path_factory.mktemp("srv-grammar") / "tiny-qwen3")
    engine = Engine.from_pretrained(model_dir, EngineConfig(max_running_requests=4, max_prefill_tokens=64,
                                                            max_model_len=512, precompile=False, grammar_states=2048))
    app = create_app(engine, ServerConfig(model_name="tiny", model_path=str(model_dir)))
    with serve_in_thread(app) as base:
        yield base, engine


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def test_response_format_json_schema_and_json_object(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for seed in (0, 1):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "colour?"}],
                                           max_tokens=60, response_format=fmt, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model="tiny", prompt="{", max_tokens=4, **GREEDY,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")
    text = client.completions.create(model="tiny", prompt="x", max_tokens=4, **GREEDY,
                                     extra_body={"response_format": {"type": "text"}}).choices[0].text
    assert text == client.completions.create(model="tiny", prompt="x", max_tokens=4, **GREEDY).choices[0].text


def test_generate_regex_and_json_schema(server):
    base, _ = server
    with httpx.Client(timeout=120) as c:
        body = {"text": "pet:", "sampling_params": {"max_new_tokens": 20, "regex": r"(cat|dog)s? [0-9]{2}", **GREEDY}}
        out = c.post(base + "/generate", json=body).json()
        assert re.fullmatch(r"(cat|dog)s? [0-9]{2}", out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"
        body = {"text": "json:", "sampling_params": {"max_new_tokens": 60, "json_schema": json.dumps(SCHEMA)}}
        jsonschema.validate(json.loads(c.post(base + "/generate", json=body).json()["text"]), SCHEMA)


@pytest.mark.parametrize("path, body, param, match", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": 5}}}}, "response_format", "invalid JSON schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "must be"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "must be"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "regex": "a"}, "regex", "at most one"),
    ("/v1/completions", {"regex": "a("}, "regex", "cannot compile the regex"),
    ("/v1/completions", {"json_schema": "{"}, "json_schema", "not valid JSON"),
    ("/generate", {"sampling_params": {"regex": "[0-9]{3000}"}}, "regex", "DFA states"),
    ("/generate", {"sampling_params": {"ebnf": "root ::= 'a'"}}, "ebnf", "EBNF"),
    ("/generate", {"sampling_params": {"structural_tag": "{}"}}, "structural_tag", "structural"),
])
def test_bad_grammars_are_400_in_openai_shape(server, path, body, param, match):
    base, engine = server
    prompt = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
              "/v1/completions": {"prompt": "hi"}, "/generate": {"text": "hi"}}[path]
    with httpx.Client(timeout=60) as c:
        r = c.post(base + path, json={**prompt, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and match in err["message"], err
    assert not engine.has_unfinished()
