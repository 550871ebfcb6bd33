"""OpenAI / SGLang request models, validation and response shapes.

Request bodies are declared as strict pydantic models (they also give the OpenAPI schema): a
wrong type, an out-of-range value, an unknown field or an option this server does not implement
raises `ApiError`, which the app turns into an OpenAI-style error body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.  Nothing is ignored
silently: a parameter that would change the output but is not implemented is refused unless it
holds its neutral value (e.g. ``repetition_penalty: 1``, ``logit_bias: {}``).  Accepted and
ignored, because they cannot change the output: ``user``, ``safety_identifier`` and ``metadata``
(end-user ids and tags for the caller's own bookkeeping).

Defaults follow OpenAI: temperature 1.0, top_p 1.0, n 1, max_tokens 16 on /v1/completions;
chat gets `ServerConfig.default_chat_max_tokens`, capped by the context left after the prompt.
`max_tokens` above the model context is rejected; a prompt plus max_tokens that overflows the
context is cut at the context (finish_reason "length").  SGLang extensions accepted on the
OpenAI endpoints: top_k, ignore_eos, stop_token_ids, return_spec_tokens_details.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dspark_jax.sampling import SamplingParams
from serving.chat import ROLES

INT32_MAX = 2**31 - 1  # top_k is an int32 device array
UINT32_MAX = 2**32 - 1  # seeds are uint32
MAX_STOP_TOKEN_IDS = 256


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


def short(v, n: int = 60) -> str:
    """A value for an error message: ASCII JSON, cut to about n characters."""
    try:
        r = json.dumps(v)
    except (TypeError, ValueError):
        r = ascii(v)
    return r if len(r) <= n else r[: n - 3] + "..."


# -- request models ----------------------------------------------------------------------------

class _Strict(BaseModel):
    # strict: "10" is not an integer, 3.0 is not an int, true is not a number.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


Seed = Annotated[int, Field(ge=0, le=UINT32_MAX, description="sampling seed (uint32); equal seeds give equal output")]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX, description="keep the k most likely tokens; 0 or -1: no cut")]
Temperature = Annotated[float, Field(ge=0, le=100, description="0 is greedy")]
TopP = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2, description="not implemented: only 0 is accepted")]
Stop = str | list[str]


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _OpenAIFields(_Strict):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: int | None = Field(None, description="only 1")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | None = Field(None, description="stop strings, excluded from the text")
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = Field(None, description="not implemented: only {} is accepted")
    response_format: dict[str, Any] | None = Field(None, description='only {"type": "text"}')
    user: str | None = Field(None, description="accepted and ignored")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    # SGLang / vLLM extensions
    top_k: TopK | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = Field(None, description="token ids that end generation")
    return_spec_tokens_details: bool | None = Field(None, description="add sglext.spec_tokens_details")
    min_p: float | None = Field(None, description="not implemented: only 0")
    repetition_penalty: float | None = Field(None, description="not implemented: only 1")
    min_tokens: int | None = Field(None, description="not implemented: only 0")
    skip_special_tokens: bool | None = Field(None, description="only true")
    regex: Any = Field(None, description="not implemented")
    json_schema: Any = Field(None, description="not implemented")
    ebnf: Any = Field(None, description="not implemented")


class CompletionRequest(_OpenAIFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, or token ids; a batch of one prompt is accepted")
    max_tokens: int | None = Field(None, ge=1, description="default 16")
    best_of: int | None = Field(None, description="only 1")
    echo: bool | None = Field(None, description="only false")
    suffix: str | None = Field(None, description="not implemented")
    logprobs: int | None = Field(None, description="not implemented")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, description="passed to the chat template")
    tool_call_id: str | None = Field(None, description="passed to the chat template")
    tool_calls: list[Any] | None = Field(None, description="not implemented: only []")


class ChatCompletionRequest(_OpenAIFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: ServerConfig.default_chat_max_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens (wins when both are set)")
    logprobs: bool | None = Field(None, description="not implemented: only false")
    top_logprobs: int | None = Field(None, description="not implemented: only 0")
    tools: list[Any] | None = Field(None, description="not implemented: only []")
    tool_choice: Any = Field(None, description='not implemented: only "none"')
    parallel_tool_calls: Any = Field(None, description="not implemented")
    functions: list[Any] | None = Field(None, description="not implemented: only []")
    function_call: Any = Field(None, description='not implemented: only "none"')
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")
    store: bool | None = Field(None, description="only false: nothing is stored")


class GenerateSamplingParams(_Strict):
    max_new_tokens: int | None = Field(None, ge=1, description="default 128")
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    n: int | None = Field(None, description="only 1")
    seed: Seed | None = None
    sampling_seed: Seed | None = Field(None, description="alias of seed")
    stop: Stop | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_p: float | None = Field(None, description="not implemented: only 0")
    presence_penalty: float | None = Field(None, description="not implemented: only 0")
    frequency_penalty: float | None = Field(None, description="not implemented: only 0")
    repetition_penalty: float | None = Field(None, description="not implemented: only 1")
    min_new_tokens: int | None = Field(None, description="not implemented: only 0")
    logit_bias: dict[str, float] | None = Field(None, description="not implemented: only {}")
    skip_special_tokens: bool | None = Field(None, description="only true")
    no_stop_trim: bool | None = Field(None, description="only false")
    json_schema: Any = Field(None, description="not implemented")
    regex: Any = Field(None, description="not implemented")
    ebnf: Any = Field(None, description="not implemented")
    structural_tag: Any = Field(None, description="not implemented")


class GenerateRequest(_Strict):
    """POST /generate (SGLang): exactly one of text and input_ids."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams | None = None
    stream: bool | None = None
    return_logprob: bool | None = Field(None, description="not implemented: only false")
    top_logprobs_num: int | None = Field(None, description="not implemented: only 0")


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, GenerateRequest)

# Parameters that change the output but are not implemented: (name, holds its neutral value,
# what is accepted).  Anything else is refused with a 400 naming the parameter.
_LOGPROBS = "log probabilities are not returned"
_NOT_IMPLEMENTED = [
    ("n", lambda v: v == 1, "only 1 is accepted (send several requests, with different seeds, instead)"),
    ("best_of", lambda v: v == 1, "only 1 is accepted"),
    ("echo", lambda v: v is False, "only false is accepted (the prompt is never echoed)"),
    ("suffix", lambda v: v == "", "only an empty suffix is accepted"),
    ("logprobs", lambda v: v is False, _LOGPROBS),
    ("top_logprobs", lambda v: v == 0, _LOGPROBS),
    ("return_logprob", lambda v: v is False, _LOGPROBS),
    ("top_logprobs_num", lambda v: v == 0, _LOGPROBS),
    ("presence_penalty", lambda v: v == 0, "only 0 (no penalty) is accepted"),
    ("frequency_penalty", lambda v: v == 0, "only 0 (no penalty) is accepted"),
    ("repetition_penalty", lambda v: v == 1, "only 1 (no penalty) is accepted"),
    ("min_p", lambda v: v == 0, "only 0 is accepted"),
    ("min_tokens", lambda v: v == 0, "only 0 is accepted"),
    ("min_new_tokens", lambda v: v == 0, "only 0 is accepted"),
    ("logit_bias", lambda v: not v, "only an empty object is accepted"),
    ("response_format", lambda v: v == {"type": "text"}, 'only {"type": "text"} is accepted (no JSON mode or structured output)'),
    ("tools", lambda v: not v, "no tool calling"),
    ("tool_choice", lambda v: v == "none", 'no tool calling (only "none" is accepted)'),
    ("parallel_tool_calls", lambda v: False, "no tool calling"),
    ("functions", lambda v: not v, "no function calling"),
    ("function_call", lambda v: v == "none", 'no function calling (only "none" is accepted)'),
    ("regex", lambda v: False, "no constrained decoding"),
    ("json_schema", lambda v: False, "no constrained decoding"),
    ("ebnf", lambda v: False, "no constrained decoding"),
    ("structural_tag", lambda v: False, "no constrained decoding"),
    ("skip_special_tokens", lambda v: v is True, "only true is accepted (special tokens are left out of the text)"),
    ("no_stop_trim", lambda v: v is False, "only false is accepted (stop strings are cut from the text)"),
    ("store", lambda v: v is False, "only false is accepted (nothing is stored)"),
]


def _refuse_unimplemented(req: BaseModel, *, param_prefix: str = "") -> None:
    for name, neutral, what in _NOT_IMPLEMENTED:
        v = getattr(req, name, None)
        if v is not None and not neutral(v):
            raise ApiError(f"'{param_prefix}{name}' is not supported by this server: {what}; got {short(v)}", param=name)


# -- validation errors -------------------------------------------------------------------------

# Union-typed fields: pydantic reports one error per union member; one plain sentence instead.
_UNION_MESSAGES = {
    "prompt": "must be a non-empty string or a non-empty list of token ids",
    "stop": "must be a string or a list of strings",
    "content": 'must be a string or a list of text parts ({"type": "text", "text": ...})',
}


def _path(loc) -> tuple[str, str | None]:
    """('messages', 0, 'content', 'str') -> ("messages[0].content", union message or None)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
            continue
        out += f".{p}" if out else str(p)
        if p in _UNION_MESSAGES:
            return out, _UNION_MESSAGES[p]
    return out, None


def _param(loc) -> str | None:
    if not loc or not isinstance(loc[0], str):
        return None
    if loc[0] == "sampling_params" and len(loc) > 1 and isinstance(loc[1], str):
        return loc[1]
    return loc[0]


def api_error_from_validation(errors: list[dict]) -> ApiError:
    """pydantic errors -> one 400 naming the field (unknown fields are all listed)."""
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        names = ", ".join(f"'{_path(e['loc'])[0]}'" for e in extra)
        return ApiError(f"unknown field{'s' if len(extra) > 1 else ''} {names}: not part of this API (parameters "
                        "this server does not implement are refused, not ignored)", param=_param(extra[0]["loc"]))
    e = errors[0]
    path, union_msg = _path(e["loc"])
    if e["type"] == "missing":
        msg = f"'{path}' is required"
    elif union_msg:
        msg = f"'{path}' {union_msg}"
    else:
        msg = f"'{path}': {e['msg']}" if path else e["msg"]
    more = len({_path(x["loc"])[0] for x in errors}) - 1
    if more > 0:
        msg += f" (and {more} more invalid field{'s' if more > 1 else ''})"
    return ApiError(msg, param=_param(e["loc"]))


def validate(model: type[BaseModel], body: dict) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise api_error_from_validation(e.errors(include_input=False, include_url=False)) from None


# -- request -> engine inputs ------------------------------------------------------------------

@dataclasses.dataclass
class Limits:
    """What a request may ask for: the model's context and vocabulary, the server's caps."""

    max_model_len: int
    vocab_size: int
    max_stop_strings: int = 16
    max_stop_chars: int = 256


@dataclasses.dataclass
class ParsedRequest:
    prompt: object  # str (text) or list[int] (token ids); None for chat (see messages)
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    spec_details: bool = False
    model: str | None = None
    messages: list[dict] | None = None
    max_tokens_given: bool = True  # chat: False when the server picks max_tokens


def _stop(v, lim: Limits, name: str = "stop") -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if len(stops) > lim.max_stop_strings:
        raise ApiError(f"'{name}' holds at most {lim.max_stop_strings} strings, got {len(stops)}", param="stop")
    for i, s in enumerate(stops):
        if not s:
            raise ApiError(f"'{name}' strings must be non-empty", param="stop")
        if len(s) > lim.max_stop_chars:
            raise ApiError(f"'{name}' strings are at most {lim.max_stop_chars} characters; string {i} has {len(s)}",
                           param="stop")
    return tuple(stops)


def _stop_ids(v, lim: Limits, name: str = "stop_token_ids") -> tuple[int, ...]:
    if not v:
        return ()
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise ApiError(f"'{name}' holds at most {MAX_STOP_TOKEN_IDS} ids, got {len(v)}", param="stop_token_ids")
    for t in v:
        if not 0 <= t < lim.vocab_size:
            raise ApiError(f"'{name}' must hold token ids in [0, {lim.vocab_size}); got {short(t)}",
                           param="stop_token_ids")
    return tuple(v)


def _max_tokens(v, default: int, lim: Limits, name: str) -> int:
    if v is None:
        return default
    if v > lim.max_model_len:
        raise ApiError(f"'{name}' must be <= {lim.max_model_len} (the context length), got {short(v)}", param=name)
    return v


def _sampling(r, lim: Limits, max_new_tokens: int, seed) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if r.temperature is None else float(r.temperature),
        top_p=1.0 if r.top_p is None else float(r.top_p),
        top_k=max(0, r.top_k or 0),
        seed=seed,
        stop=_stop(r.stop, lim),
        stop_token_ids=_stop_ids(r.stop_token_ids, lim),
        ignore_eos=bool(r.ignore_eos),
    )


def _openai_common(r: _OpenAIFields, lim: Limits, max_new_tokens: int) -> dict:
    _refuse_unimplemented(r)
    return {"params": _sampling(r, lim, max_new_tokens, r.seed), "stream": bool(r.stream),
            "include_usage": bool(r.stream_options and r.stream_options.include_usage),
            "spec_details": bool(r.return_spec_tokens_details), "model": r.model}


def parse_completion(body: dict, lim: Limits) -> ParsedRequest:
    r: CompletionRequest = validate(CompletionRequest, body)
    p = r.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        raise ApiError("batched prompts are not supported: send one prompt per request", param="prompt")
    if not p:
        raise ApiError("'prompt' is empty", param="prompt")
    return ParsedRequest(p, **_openai_common(r, lim, _max_tokens(r.max_tokens, 16, lim, "max_tokens")))


def parse_chat(body: dict, lim: Limits, default_max_tokens: int) -> ParsedRequest:
    r: ChatCompletionRequest = validate(ChatCompletionRequest, body)
    messages = []
    for i, m in enumerate(r.messages):
        if m.tool_calls:
            raise ApiError(f"'messages[{i}].tool_calls' is not supported by this server (no tool calling)",
                           param="messages")
        c = m.content
        if isinstance(c, list):
            c = "".join(part.text for part in c)
        if c is None:
            if m.role != "assistant":
                raise ApiError(f"'messages[{i}].content' is required for role {m.role!r}", param="messages")
            c = ""
        msg = {"role": m.role, "content": c}
        msg.update({k: v for k in ("name", "tool_call_id") if (v := getattr(m, k)) is not None})
        messages.append(msg)
    key = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
    given = getattr(r, key)
    max_new = _max_tokens(given, default_max_tokens, lim, key)
    return ParsedRequest(None, **_openai_common(r, lim, max_new), messages=messages, max_tokens_given=given is not None)


def parse_generate(body: dict, lim: Limits) -> ParsedRequest:
    """SGLang /generate: {text | input_ids, sampling_params{...}, stream}."""
    r: GenerateRequest = validate(GenerateRequest, body)
    if (r.text is None) == (r.input_ids is None):
        raise ApiError("give exactly one of 'text' and 'input_ids'", param="text")
    if r.text is not None and not r.text:
        raise ApiError("'text' must be a non-empty string (batches are not supported)", param="text")
    if r.input_ids is not None and not r.input_ids:
        raise ApiError("'input_ids' must be a non-empty list of integers (batches are not supported)", param="input_ids")
    _refuse_unimplemented(r)
    sp = r.sampling_params or GenerateSamplingParams()
    _refuse_unimplemented(sp, param_prefix="sampling_params.")
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise ApiError("'sampling_params.seed' and 'sampling_params.sampling_seed' differ", param="seed")
    seed = sp.seed if sp.seed is not None else sp.sampling_seed
    params = _sampling(sp, lim, _max_tokens(sp.max_new_tokens, 128, lim, "max_new_tokens"), seed)
    return ParsedRequest(r.text if r.text is not None else r.input_ids, params, bool(r.stream))


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
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace") + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
