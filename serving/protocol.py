"""OpenAI / SGLang request parsing and response shapes.

Parsing is explicit (no silent coercion): a wrong type, an out-of-range value or an unsupported
option raises `ApiError`, which the app turns into an OpenAI-style error body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.

Defaults follow OpenAI: temperature 1.0, top_p 1.0, n 1, max_tokens 16 on /v1/completions and
"up to the context" on chat.  `max_tokens` above the model context is rejected; a prompt plus
max_tokens that overflows the context is cut at the context (finish_reason "length").
SGLang extensions accepted on the OpenAI endpoints: top_k, ignore_eos, stop_token_ids,
return_spec_tokens_details.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

from dspark_jax.sampling import SamplingParams
from serving.chat import ROLES


class ApiError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type
        self.code = code if code is not None else status
        self.headers = headers

    def body(self) -> dict:
        # A message may quote request text: never let a lone surrogate break the response itself.
        clean = lambda s: s.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(s, str) else s
        return {"error": {"message": clean(self.message), "type": self.type, "param": clean(self.param), "code": self.code}}


_MISSING = object()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body: dict, name: str, default, *, lo=None, hi=None):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not _is_int(v):
        raise ApiError(f"'{name}' must be an integer, got {type(v).__name__}", param=name)
    if lo is not None and v < lo:
        raise ApiError(f"'{name}' must be >= {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise ApiError(f"'{name}' must be <= {hi}, got {v}", param=name)
    return v


def _num(body: dict, name: str, default, *, lo=None, hi=None, lo_open=False):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not _is_num(v):
        raise ApiError(f"'{name}' must be a finite number, got {v!r}", param=name)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise ApiError(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise ApiError(f"'{name}' must be <= {hi}, got {v}", param=name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{name}' must be a boolean, got {type(v).__name__}", param=name)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise ApiError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(v) > 16:
        raise ApiError("'stop' holds at most 16 strings", param="stop")
    return tuple(v)


def _int_list(body: dict, name: str) -> tuple[int, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise ApiError(f"'{name}' must be a list of integers", param=name)
    return tuple(v)


@dataclasses.dataclass
class ParsedRequest:
    prompt: object  # str (text) or list[int] (token ids)
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    spec_details: bool = False
    model: str | None = None


def _openai_common(body: dict, *, max_model_len: int, default_max_tokens: int, max_tokens_key=("max_tokens",)) -> tuple:
    n = _int(body, "n", 1)
    if n != 1:
        raise ApiError(f"only n=1 is supported, got n={n}; send {n} requests (with different seeds) instead", param="n")
    if _int(body, "best_of", 1) != 1:
        raise ApiError("best_of is not supported", param="best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if _num(body, name, 0.0, lo=-2.0, hi=2.0) != 0.0:
            raise ApiError(f"'{name}' is not supported (must be 0)", param=name)
    lp = body.get("logprobs")
    if lp not in (None, False, 0):
        raise ApiError("logprobs are not supported", param="logprobs")
    if body.get("echo"):
        raise ApiError("echo is not supported", param="echo")
    max_tokens = default_max_tokens
    for key in max_tokens_key:
        if body.get(key) is not None:
            max_tokens = _int(body, key, None, lo=1, hi=max_model_len)
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_num(body, "temperature", 1.0, lo=0.0, hi=100.0),
        top_p=_num(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=max(0, _int(body, "top_k", 0, lo=-1)),
        seed=_int(body, "seed", None, lo=0, hi=2**32 - 1),
        stop=_stop(body),
        stop_token_ids=_int_list(body, "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos", False),
    )
    stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError("'stream_options' must be an object", param="stream_options")
        include_usage = _bool(so, "include_usage", False)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError("'model' must be a string", param="model")
    return params, stream, include_usage, _bool(body, "return_spec_tokens_details", False), model


def parse_completion(body: dict, *, max_model_len: int) -> ParsedRequest:
    if "prompt" not in body:
        raise ApiError("'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise ApiError("'prompt' is empty", param="prompt")
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        pass
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise ApiError("batched prompts are not supported: send one prompt per request", param="prompt")
    else:
        raise ApiError("'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt")
    params, stream, usage, spec, model = _openai_common(body, max_model_len=max_model_len, default_max_tokens=16)
    return ParsedRequest(p, params, stream, usage, spec, model)


def parse_chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}", param="messages")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            parts = []
            for part in c:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"messages[{i}].content: only text parts are supported", param="messages")
                parts.append(part["text"])
            c = "".join(parts)
        if c is None and role == "assistant":
            c = ""
        if not isinstance(c, str):
            raise ApiError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({"role": role, "content": c})
    return out


def parse_chat(body: dict, *, max_model_len: int) -> tuple[list[dict], ParsedRequest]:
    messages = parse_chat_messages(body)
    params, stream, usage, spec, model = _openai_common(
        body, max_model_len=max_model_len, default_max_tokens=max_model_len,
        max_tokens_key=("max_tokens", "max_completion_tokens"),
    )
    return messages, ParsedRequest(None, params, stream, usage, spec, model)


def parse_generate(body: dict, *, max_model_len: int) -> ParsedRequest:
    """SGLang /generate: {text | input_ids, sampling_params{...}, stream}."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError("give exactly one of 'text' and 'input_ids'", param="text")
    if text is not None and (not isinstance(text, str) or not text):
        raise ApiError("'text' must be a non-empty string (batches are not supported)", param="text")
    if ids is not None and (not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids)):
        raise ApiError("'input_ids' must be a non-empty list of integers (batches are not supported)", param="input_ids")
    sp = body.get("sampling_params")
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise ApiError("'sampling_params' must be an object", param="sampling_params")
    if _int(sp, "n", 1) != 1:
        raise ApiError("only n=1 is supported", param="n")
    params = SamplingParams(
        max_new_tokens=_int(sp, "max_new_tokens", 128, lo=1, hi=max_model_len),
        temperature=_num(sp, "temperature", 1.0, lo=0.0, hi=100.0),
        top_p=_num(sp, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=max(0, _int(sp, "top_k", 0, lo=-1)),
        seed=_int(sp, "seed", None, lo=0, hi=2**32 - 1) if "seed" in sp else _int(sp, "sampling_seed", None, lo=0, hi=2**32 - 1),
        stop=_stop(sp),
        stop_token_ids=_int_list(sp, "stop_token_ids"),
        ignore_eos=_bool(sp, "ignore_eos", False),
    )
    return ParsedRequest(text if text is not None else ids, params, _bool(body, "stream", False))


# -- responses ---------------------------------------------------------------------------------

def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def spec_fields(result) -> dict:
    """SGLang meta_info spec_* fields from GenerationResult.stats["spec"] (empty when not speculative)."""
    s = result.stats.get("spec")
    if not s:
        return {}
    return {
        "spec_verify_ct": s["verify_ct"],
        "spec_accept_length": s["accept_length"],
        "spec_accept_lens": s["accept_lens"],
        "spec_cap_length": s["window"],
        "spec_cap_lens_histogram": s["window_histogram"],
        "spec_block_accept_length": s["block_accept_length"],
        "spec_utilization": s["utilization"],
    }


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
