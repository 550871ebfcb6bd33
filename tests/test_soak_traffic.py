"""The soak test's judge of a streamed answer, on hand-written streams: OpenAI sends a usage chunk
only when ``stream_options.include_usage`` asks for it, so a stream is judged by what it asked."""

import random

from benchmarks.soak_traffic import Checker, Req, StreamState, Traffic


def judge(body: dict, chunks: list[dict]) -> list[str]:
    req = Req("ok", "completions", "/v1/completions", body, stream=True, max_tokens=4)
    st, c = StreamState(req, 0.0), Checker()
    for obj in chunks:
        st.chunk(obj, c)
    st.close(c, done=True)
    return c.problems


TEXT = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
END = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def test_usage_is_required_exactly_when_asked_for():
    asked = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    unasked = {"prompt": "x", "stream": True}
    assert judge(asked, [TEXT, END, USAGE]) == []
    assert judge(asked, [TEXT, END]) == ["no usage chunk"]
    assert judge(unasked, [TEXT, END]) == []
    assert judge(unasked, [TEXT, END, USAGE]) == ["a usage chunk not asked for"]


def test_disconnecting_streams_ask_for_usage_on_openai_endpoints():
    traffic = Traffic(random.Random(0), {}, list(range(10, 200)), max_tokens=8, bad_rate=0.0, disconnect_rate=1.0)
    reqs = [traffic.next() for _ in range(200)]
    assert {r.scenario for r in reqs} == {"disconnect"} and all(r.body["stream"] for r in reqs)
    openai = [r for r in reqs if r.endpoint != "generate"]
    assert openai and all(r.body["stream_options"] == {"include_usage": True} for r in openai)
