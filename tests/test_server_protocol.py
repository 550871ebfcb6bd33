"""Request parsing bounds and validation messages (serving/jsonbody.py, serving/protocol.py,
serving/params.py): no engine."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("fastapi")

from serving.errors import ApiError  # noqa: E402
from serving.jsonbody import MAX_DEPTH, MAX_INT_DIGITS, parse_json_body  # noqa: E402
from serving.params import Limits, parse_chat, parse_completion, parse_generate  # noqa: E402
from serving.protocol import (  # noqa: E402
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
)

LIM = Limits(max_model_len=128, vocab_size=300, max_choices=8)


def _refused(raw: bytes, phrase: str) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_json_body(raw)
    assert e.value.status == 400 and phrase in e.value.message, e.value.message
    return e.value


def test_json_nesting_is_bounded_outside_strings_only():
    def nest(d):
        return b'{"a": ' + b"[" * (d - 1) + b"]" * (d - 1) + b"}"

    assert parse_json_body(nest(MAX_DEPTH))["a"]
    _refused(nest(MAX_DEPTH + 1), "nested too deeply")
    _refused(nest(100_000), "nested too deeply")
    # brackets and escaped quotes inside strings do not count
    s = '"' + '[[[{{{\\"[[' * 50 + '"'
    assert parse_json_body(('{"prompt": ' + s + ', "stop": [' + s + "]}").encode())["stop"][0].startswith("[[[{{{")


def test_json_numbers_are_bounded():
    assert parse_json_body(b'{"seed": ' + b"9" * MAX_INT_DIGITS + b"}")["seed"] == 10**MAX_INT_DIGITS - 1
    _refused(b'{"seed": ' + b"9" * (MAX_INT_DIGITS + 1) + b"}", "digits")
    _refused(b'{"seed": -' + b"9" * 5000 + b"}", "digits")
    # a long run of digits inside a string is text, not a number
    assert parse_json_body(b'{"prompt": "' + b"7" * 500 + b'", "n": 1}')["n"] == 1
    for const in (b"NaN", b"Infinity", b"-Infinity"):
        _refused(b'{"temperature": ' + const + b"}", "not a valid JSON number")
    assert parse_json_body(b'{"temperature": 1e400}')["temperature"] == float("inf")  # refused by the model


def test_json_text_must_be_valid_unicode():
    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00 ok"}')["prompt"] == "\U0001F600 ok"  # a surrogate pair
    e = _refused(b'{"messages": [{"role": "user", "content": "a\\ud83d"}]}', "lone UTF-16 surrogate")
    assert e.param == "messages" and "messages[0].content" in e.message and "\\ud83d" in e.message
    assert parse_json_body(b'{"prompt": "\\\\ud800"}')["prompt"] == "\\ud800"  # an escaped backslash, not a surrogate
    _refused(b'{"prompt": "\xff"}', "UTF-8")
    _refused(b"[1]", "JSON object")
    _refused(b'{"prompt": ', "not valid JSON")


def test_every_refused_parameter_is_a_declared_field():
    fields = set()
    for m in (CompletionRequest, ChatCompletionRequest, GenerateRequest, GenerateSamplingParams):
        fields |= set(m.model_fields)
    assert set(UNSUPPORTED) <= fields


def test_validation_messages_name_the_field():
    cases = [
        (parse_completion, {"prompt": "hi", "max_tokens": "10"}, "max_tokens", "'max_tokens': Input should be a valid integer"),
        (parse_completion, {"prompt": {"a": 1}}, "prompt", "'prompt' must be a non-empty string or list of token ids"),
        (parse_completion, {}, "prompt", "'prompt' is required"),
        (parse_completion, {"prompt": "hi", "max_tokens": "x", "top_p": 2}, "top_p", "(and 1 more invalid field)"),
        (parse_completion, {"prompt": "hi", "temperature": 1e400}, "temperature", "finite"),
        (parse_completion, {"prompt": "hi", "max_tokens": 129}, "max_tokens", "<= 128 (the context length)"),
        (parse_completion, {"prompt": "hi", "stop_token_ids": [300]}, "stop_token_ids", "[0, 300)"),
        (parse_completion, {"prompt": [[1, 2], []]}, "prompt", "'prompt[1]' is empty"),
        (parse_completion, {"prompt": ["a", ""]}, "prompt", "'prompt[1]' is empty"),
        (parse_completion, {"prompt": []}, "prompt", "'prompt' is empty"),
        (parse_completion, {"prompt": "hi", "n": 0}, "n", "greater than or equal to 1"),
        (parse_completion, {"prompt": "hi", "n": 9}, "n", "at most 8 choices per request, got n = 9"),
        (parse_completion, {"prompt": ["a", "b", "c"], "n": 3}, "n", "3 prompts x n = 3"),
        (parse_completion, {"prompt": "hi", "n": 2, "best_of": 1}, "best_of", "must be >= n (2)"),
        (parse_completion, {"prompt": "hi", "n": 2, "best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
        (parse_completion, {"prompt": "hi", "n": 2, "best_of": 9}, "best_of", "at most 8 choices"),
        (parse_completion, {"prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        (parse_completion, {"prompt": "hi", "logprobs": 1, "echo": True}, "logprobs", "echo"),
        (lambda b, lim: parse_chat(b, lim, 64), {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
         "top_logprobs", "needs 'logprobs': true"),
        (parse_generate, {"text": "a", "top_logprobs_num": 2}, "top_logprobs_num", "needs 'return_logprob'"),
        (parse_completion, {"prompt": "hi", "logit_bias": {"300": 1}}, "logit_bias", "outside the vocabulary"),
        (parse_completion, {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "integer token ids"),
        (parse_completion, {"prompt": "hi", "logit_bias": {"3": 101}}, "logit_bias", "[-100, 100]"),
        (parse_completion, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        (parse_completion, {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        (parse_completion, {"prompt": "hi", "min_tokens": 17}, "min_tokens", "max_new_tokens=16"),
        (parse_generate, {"text": "a", "sampling_params": {"min_new_tokens": 200, "max_new_tokens": 5}},
         "min_new_tokens", "min_new_tokens must be"),
        (parse_generate, {"text": ["a", "b"], "sampling_params": {"n": 5}}, "n", "2 prompts x n = 5"),
        (parse_generate, {"input_ids": [[1], []]}, "input_ids", "'input_ids[1]' is empty"),
        (lambda b, lim: parse_chat(b, lim, 64), {"messages": [{"role": "user"}]}, "messages", "content' is required"),
        (lambda b, lim: parse_chat(b, lim, 64), {"messages": [{"role": "bot", "content": "x"}]}, "messages",
         "'messages[0].role'"),
        (parse_generate, {"text": "a", "input_ids": [1]}, "text", "exactly one"),
        (parse_generate, {"text": "a", "sampling_params": {"seed": 1, "sampling_seed": 2}}, "seed", "differ"),
    ]
    for parse, body, param, phrase in cases:
        with pytest.raises(ApiError) as e:
            parse(body, LIM)
        assert e.value.status == 400 and e.value.param == param and phrase in e.value.message, (body, e.value.message)


def test_parsed_values():
    p = parse_completion({"prompt": [[5, 6]], "top_k": -1, "seed": 2**32 - 1, "stop": "x", "stream": True,
                          "stream_options": {"include_usage": True}}, LIM)
    assert p.prompts == [[5, 6]] and p.params.top_k == 0 and p.params.seed == 2**32 - 1 and p.params.stop == ("x",)
    assert p.stream and p.include_usage and p.params.max_new_tokens == 16 and p.params.temperature == 1.0
    c = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                 {"role": "assistant", "content": None, "name": "bot"}]}, LIM, 64)
    assert c.prompts == [[{"role": "user", "content": "ab"}, {"role": "assistant", "content": "", "name": "bot"}]]
    assert c.params.max_new_tokens == 64 and not c.max_tokens_given
    g = parse_generate({"input_ids": [1, 2], "sampling_params": {"sampling_seed": 9, "max_new_tokens": 3}}, LIM)
    assert g.prompts == [[1, 2]] and not g.batched and g.params.seed == 9 and g.params.max_new_tokens == 3


def test_logprobs_penalties_and_best_of_reach_sampling_params():
    p = parse_completion({"prompt": "hi", "logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": -1,
                          "repetition_penalty": 1.2, "min_tokens": 4, "logit_bias": {"7": -100, "9": 2.5}}, LIM)
    sp = p.params
    assert (p.logprobs, sp.logprobs, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_tokens,
            sp.logit_bias) == (3, 3, 0.5, -1.0, 1.2, 4, {7: -100.0, 9: 2.5})
    b = parse_completion({"prompt": ["a", "b"], "n": 2, "best_of": 3, "seed": 5}, LIM)
    assert (b.best_of, b.per_prompt, b.num_choices, b.logprobs, b.params.logprobs) == (3, 3, 6, None, 0)
    assert [sp.seed for _, sp in b.jobs([[1], [2]], LIM.max_model_len)] == [5, 6, 7] * 2
    c = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 5}, LIM, 8)
    assert (c.logprobs, c.params.logprobs) == (5, 5)
    c0 = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": False}, LIM, 8)
    assert (c0.logprobs, c0.params.logprobs) == (None, None)
    g = parse_generate({"text": "a", "return_logprob": True, "top_logprobs_num": 2, "sampling_params": {
        "min_new_tokens": 3, "repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.1}}, LIM)
    assert (g.logprobs, g.params.min_tokens, g.params.repetition_penalty, g.params.frequency_penalty,
            g.params.presence_penalty) == (2, 3, 1.1, 0.3, 0.1)
    # an engine without logit processors refuses them, naming them
    off = dataclasses.replace(LIM, logit_processors=False)
    for parse, body, named in ((parse_completion, {"prompt": "hi", "logprobs": 0}, "'logprobs'"),
                               (parse_completion, {"prompt": "hi", "best_of": 2}, "'best_of'"),
                               (parse_completion, {"prompt": "hi", "presence_penalty": 1, "logit_bias": {"1": 1}},
                                "'presence_penalty', 'logit_bias' are"),
                               (parse_generate, {"text": "a", "sampling_params": {"min_new_tokens": 1}},
                                "'min_new_tokens' is")):
        with pytest.raises(ApiError, match="logit-processors off") as e:
            parse(body, off)
        assert named in e.value.message and e.value.param == named.split("'")[1], e.value.message
    assert parse_completion({"prompt": "hi", "presence_penalty": 0, "logit_bias": {}}, off).params.logit_bias == {}


def test_choices_seeds_and_batches():
    """n engine requests per prompt, prompt-major; with a seed choice j samples with seed + j
    (mod 2**32) whatever the prompt; the chat default max_tokens is capped per prompt."""
    p = parse_completion({"prompt": [[5, 6], [7]], "n": 3, "best_of": 3, "seed": 2**32 - 2, "echo": True,
                          "user": "u"}, LIM)
    assert p.batched and p.echo and p.n == 3 and p.num_choices == 6
    jobs = p.jobs([[5, 6], [7]], LIM.max_model_len)
    assert [ids for ids, _ in jobs] == [[5, 6]] * 3 + [[7]] * 3
    assert [sp.seed for _, sp in jobs] == [2**32 - 2, 2**32 - 1, 0] * 2
    assert p.params.seed == 2**32 - 2  # the request's own params are left alone
    unseeded = parse_completion({"prompt": "hi", "n": 2}, LIM).jobs([[1, 2]], LIM.max_model_len)
    assert [sp.seed for _, sp in unseeded] == [None, None]  # the engine draws one per request
    single = parse_completion({"prompt": [[5, 6]]}, LIM)
    assert single.batched and single.prompts == [[5, 6]] and not parse_completion({"prompt": [5, 6]}, LIM).batched
    c = parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 2}, LIM, 10**6)
    assert [sp.max_new_tokens for _, sp in c.jobs([[1] * 100], LIM.max_model_len)] == [28, 28]
    m = parse_chat({"messages": [{"role": "user", "content": "x"}], "min_tokens": 50}, LIM, 64)
    assert [(sp.max_new_tokens, sp.min_tokens) for _, sp in m.jobs([[1] * 100], LIM.max_model_len)] == [(28, 28)]
    g = parse_generate({"text": ["a", "b"], "sampling_params": {"n": 2, "seed": 4}}, LIM)
    assert g.batched and [sp.seed for _, sp in g.jobs([[1], [2]], LIM.max_model_len)] == [4, 5, 4, 5]
