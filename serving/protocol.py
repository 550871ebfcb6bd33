"""OpenAI / SGLang request models, and the one list of parameters this server refuses.

Request bodies are declared as strict pydantic models (they also give the OpenAPI schema): a
wrong type, an out-of-range value or an unknown field is a 400 naming the field.  Nothing is
ignored silently: a parameter that would change the output but is not implemented is refused
(`UNSUPPORTED`) unless it holds its neutral value (e.g. ``min_p: 0``, ``tools: []``).  Accepted
and ignored, because they cannot change the output: ``user``, ``safety_identifier`` and
``metadata`` (ids and tags for the caller's own bookkeeping).

What the accepted fields mean, and their defaults, is in serving/params.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dspark_jax.logprobs import MAX_LOGPROBS
from serving.chat import ROLES
from serving.errors import ApiError, api_error_from_validation, short

INT32_MAX = 2**31 - 1  # top_k is an int32 device array
UINT32_MAX = 2**32 - 1  # seeds are uint32


class _Strict(BaseModel):
    # strict: "10" is not an integer, 3.0 is not an int, true is not a number.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


Seed = Annotated[int, Field(ge=0, le=UINT32_MAX, description="sampling seed (uint32); equal seeds give equal "
                                                             "output; choice j of n uses seed + j")]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX, description="keep the k most likely tokens; 0 or -1: no cut")]
Temperature = Annotated[float, Field(ge=0, le=100, description="0 is greedy")]
TopP = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2, description="OpenAI presence / frequency penalty")]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS, description=f"alternatives per token (at most {MAX_LOGPROBS})")]
N = Annotated[int, Field(ge=1, description="choices per prompt: n engine requests")]
Stop = str | list[str]


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _SamplingFields(_Strict):
    """Sampling fields of every endpoint (/generate's sit in its sampling_params)."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    n: N | None = None
    seed: Seed | None = None
    stop: Stop | None = Field(None, description="stop strings, excluded from the text")
    stop_token_ids: list[int] | None = Field(None, description="token ids that end generation")
    ignore_eos: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, gt=0, description="HF / vLLM: > 1 discourages prompt and "
                                                                       "generated tokens")
    min_p: float | None = Field(None, description="not implemented: only 0")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100], added to its logit")
    skip_special_tokens: bool | None = Field(None, description="only true")
    regex: str | None = Field(None, description="the output matches this regex (structured output)")
    json_schema: str | None = Field(None, description="the output is JSON following this JSON schema, given as a "
                                                      "JSON string (structured output)")
    ebnf: Any = Field(None, description="not implemented")


class _OpenAIFields(_SamplingFields):
    """Fields common to /v1/completions and /v1/chat/completions (top_k, ignore_eos,
    stop_token_ids and return_spec_tokens_details are SGLang / vLLM extensions)."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name": ..., "schema": {...}}}: the output is any JSON object / follows the schema')
    user: str | None = Field(None, description="accepted and ignored")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    return_spec_tokens_details: bool | None = Field(None, description="add sglext.spec_tokens_details")
    min_tokens: int | None = Field(None, ge=0, description="EOS and stop_token_ids are masked until this many tokens")


class CompletionRequest(_OpenAIFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text or token ids, or a batch of either (choices are indexed prompt-major)")
    max_tokens: int | None = Field(None, ge=1, description="default 16")
    best_of: int | None = Field(None, ge=1, description="generate best_of, return the n with the highest cumulative "
                                                        "logprob (not with stream)")
    echo: bool | None = Field(None, description="prepend the prompt to each choice's text")
    suffix: str | None = Field(None, description="not implemented")
    logprobs: TopLogprobs | None = Field(None, description="return each token's logprob and this many alternatives")


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
    logprobs: bool | None = Field(None, description="return each token's logprob")
    top_logprobs: TopLogprobs | None = Field(None, description="alternatives per token (needs logprobs: true)")
    tools: list[Any] | None = Field(None, description="not implemented: only []")
    tool_choice: Any = Field(None, description='not implemented: only "none"')
    parallel_tool_calls: Any = Field(None, description="not implemented")
    functions: list[Any] | None = Field(None, description="not implemented: only []")
    function_call: Any = Field(None, description='not implemented: only "none"')
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")
    store: bool | None = Field(None, description="only false: nothing is stored")


class GenerateSamplingParams(_SamplingFields):
    max_new_tokens: int | None = Field(None, ge=1, description="default 128")
    sampling_seed: Seed | None = Field(None, description="alias of seed")
    min_new_tokens: int | None = Field(None, ge=0, description="EOS and stop_token_ids are masked until this many")
    no_stop_trim: bool | None = Field(None, description="only false")
    structural_tag: Any = Field(None, description="not implemented")


class GenerateRequest(_Strict):
    """POST /generate (SGLang): exactly one of text and input_ids; a list of them is a batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSamplingParams | None = None
    stream: bool | None = None
    return_logprob: bool | None = Field(None, description="meta_info output_token_logprobs: [logprob, id, None]")
    top_logprobs_num: TopLogprobs | None = Field(None, description="meta_info output_top_logprobs per token "
                                                                   "(needs return_logprob)")


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, GenerateRequest)


def body_schema(model) -> dict:
    """openapi_extra of a route whose body is parsed by hand (within bounds) into `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


# Parameters that change the output but are not implemented: name -> (holds its neutral value,
# what is accepted).  A non-neutral value is refused with a 400 naming the parameter.  Enabling
# one is deleting its line here (and passing it on in serving/params.py).
UNSUPPORTED: dict[str, tuple] = {
    "suffix": (lambda v: v == "", "only an empty suffix is accepted"),
    "min_p": (lambda v: v == 0, "only 0 is accepted"),
    "tools": (lambda v: not v, "no tool calling"),
    "tool_choice": (lambda v: v == "none", 'no tool calling (only "none" is accepted)'),
    "parallel_tool_calls": (lambda v: False, "no tool calling"),
    "functions": (lambda v: not v, "no function calling"),
    "function_call": (lambda v: v == "none", 'no function calling (only "none" is accepted)'),
    "ebnf": (lambda v: False, "no EBNF grammars (regex, json_schema and response_format are)"),
    "structural_tag": (lambda v: False, "no structural tags (regex, json_schema and response_format are)"),
    "skip_special_tokens": (lambda v: v is True, "only true is accepted (special tokens are left out of the text)"),
    "no_stop_trim": (lambda v: v is False, "only false is accepted (stop strings are cut from the text)"),
    "store": (lambda v: v is False, "only false is accepted (nothing is stored)"),
}


def refuse_unsupported(req: BaseModel, *, param_prefix: str = "") -> None:
    for name, (neutral, what) in UNSUPPORTED.items():
        v = getattr(req, name, None)
        if v is not None and not neutral(v):
            raise ApiError(f"'{param_prefix}{name}' is not supported by this server: {what}; got {short(v)}", param=name)


def validate(model: type[BaseModel], body: dict) -> BaseModel:
    """The body as `model`, unsupported parameters refused; a 400 naming the field otherwise."""
    try:
        r = model.model_validate(body)
    except ValidationError as e:
        raise api_error_from_validation(e.errors(include_input=False, include_url=False)) from None
    refuse_unsupported(r)
    if isinstance(r, GenerateRequest) and r.sampling_params is not None:
        refuse_unsupported(r.sampling_params, param_prefix="sampling_params.")
    return r
