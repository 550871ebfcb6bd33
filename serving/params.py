"""Validated requests -> what the engine takes: prompts, SamplingParams, and how many choices.

Defaults follow OpenAI: temperature 1.0, top_p 1.0, n 1, max_tokens 16 on /v1/completions;
chat gets `ServerConfig.default_chat_max_tokens`, capped by the context left after the prompt;
/generate 128.  `max_tokens` above the model context is rejected; a prompt plus max_tokens that
overflows the context is cut at the context (finish_reason "length").  SGLang extensions
accepted on the OpenAI endpoints: top_k, ignore_eos, stop_token_ids, return_spec_tokens_details.

Several choices, all request-level (so they hold at every speculative setting):

- ``n``: n engine requests per prompt.  With a seed, choice j of a prompt samples with seed + j
  (mod 2**32), so n choices with seed s equal n single requests with seeds s .. s+n-1; without
  one, each draws its own.  (Exactly equal wherever a seeded request's tokens do not depend on
  what shares its batch: plain decoding, static DSpark rounds, MTP, and greedy everywhere.
  Compact / cap-accept verify windows are chosen across the batch, so there a sampled request's
  tokens, n or not, depend on its batch; the distribution does not.)
- ``best_of`` (/v1/completions): best_of engine requests per prompt (seeds as for n), of which
  the n with the highest cumulative logprob are returned, best first (vLLM); refused with
  ``stream``.  Usage counts every candidate's tokens.
- a batch of prompts (/v1/completions ``prompt``, /generate ``text`` / ``input_ids`` as a list):
  choice index = prompt_index * n + j (prompt-major, like vLLM); every prompt uses the same
  seeds, so a batch equals one request per prompt.  Usage sums over prompts (prompt tokens are
  counted once per prompt, not per choice).
- ``echo`` (/v1/completions): the prompt text is prepended to each choice's text.

At most `Limits.max_choices` engine requests per HTTP request (prompts x max(n, best_of)).

Logprobs, penalties, logit bias and min_tokens (dspark_jax/logit_processors.py, logprobs.py):
/v1/completions ``logprobs: k``, chat ``logprobs: true`` + ``top_logprobs: k``, /generate
``return_logprob`` + ``top_logprobs_num: k`` ask for each token's raw logprob and the top k;
``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``min_tokens`` (/generate:
``min_new_tokens``) and ``logit_bias`` go to SamplingParams as they are.  An engine without
logit processors (``--logit-processors off``) refuses them all with a 400 naming them.

Structured output (dspark_jax/grammar): OpenAI's ``response_format`` ({"type": "json_object"},
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; "text" is no constraint)
and SGLang's ``regex`` / ``json_schema`` (a JSON string), at most one per request, become
SamplingParams.grammar; the grammar is compiled on the tokenize pool (dispatch.compile_grammar),
where an invalid or too large one is a 400 naming the parameter.
"""

from __future__ import annotations

import dataclasses
import json

from dspark_jax.errors import InvalidRequestError
from dspark_jax.sampling import SamplingParams
from serving.errors import ApiError, short
from serving.protocol import (
    UINT32_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
    validate,
)

MAX_STOP_TOKEN_IDS = 256


@dataclasses.dataclass
class Limits:
    """What a request may ask for: the model's context and vocabulary, the server's caps."""

    max_model_len: int
    vocab_size: int
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_choices: int = 128  # engine requests per HTTP request (prompts x n)
    logit_processors: bool = True  # the engine runs logprobs, penalties, logit bias, min_tokens


@dataclasses.dataclass
class ParsedRequest:
    prompts: list  # each a str (text) or list[int] (token ids); chat: one list of message dicts
    params: SamplingParams
    n: int = 1
    batched: bool = False  # the client sent a list of prompts
    stream: bool = False
    include_usage: bool = False
    spec_details: bool = False
    model: str | None = None
    echo: bool = False
    max_tokens_given: bool = True  # chat: False when the server picks max_tokens
    logprobs: int | None = None  # top k the client asked for (None: no logprobs in the answer)
    best_of: int | None = None  # > n: candidates per prompt, the best n returned
    grammar_param: str | None = None  # the parameter that set params.grammar (named by its errors)

    @property
    def per_prompt(self) -> int:
        """Engine requests per prompt."""
        return max(self.n, self.best_of or 0)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.per_prompt

    def jobs(self, prompt_ids: list[list[int]], max_model_len: int) -> list[tuple[list[int], SamplingParams]]:
        """One (token ids, params) per choice, in choice-index order (prompt-major)."""
        out = []
        for ids in prompt_ids:
            base = self.params
            if not self.max_tokens_given:  # the server's default, within the context the prompt leaves
                new_max = max(1, min(base.max_new_tokens, max_model_len - len(ids)))
                base = dataclasses.replace(base, max_new_tokens=new_max, min_tokens=min(base.min_tokens, new_max))
            for j in range(self.per_prompt):
                seed = None if base.seed is None else (base.seed + j) % (UINT32_MAX + 1)
                out.append((ids, dataclasses.replace(base, seed=seed)))
        return out


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


def _grammar(r) -> tuple[tuple[str, str] | None, str | None]:
    """(SamplingParams.grammar, the parameter that set it) of a request's structured-output fields."""
    given = [(name, v) for name in ("response_format", "regex", "json_schema")
             if (v := getattr(r, name, None)) is not None and v != {"type": "text"}]
    if len(given) > 1:
        raise ApiError(f"give at most one of {', '.join(repr(n) for n, _ in given)}", param=given[1][0])
    if not given:
        return None, None
    name, v = given[0]
    if name != "response_format":
        return (name, v), name
    kind = v.get("type")
    if kind == "json_object" and set(v) == {"type"}:
        return ("json_object", ""), name
    spec = v.get("json_schema")
    if kind != "json_schema" or set(v) != {"type", "json_schema"}:
        raise ApiError('\'response_format\' must be {"type": "text"}, {"type": "json_object"} or {"type": '
                       f'"json_schema", "json_schema": {{...}}}}; got {short(v)}', param=name)
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict) \
            or not set(spec) <= {"name", "description", "schema", "strict"}:
        raise ApiError("'response_format.json_schema' must be an object with 'name' and 'schema' (an object), "
                       f"and optionally 'description' and 'strict'; got {short(spec)}", param=name)
    return ("json_schema", json.dumps(spec.get("schema", {}))), name


_PROCESSOR_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias")


def _sampling(r, lim: Limits, max_new_tokens: int, seed, *, logprobs: int | None = None,
              min_tokens_name: str = "min_tokens", asked: tuple[str, ...] = ()) -> SamplingParams:
    """SamplingParams of a request's sampling fields; `asked`: the logprob parameters it set
    (named when the engine has no logit processors)."""
    min_tokens = getattr(r, min_tokens_name, None) or 0
    grammar, grammar_param = _grammar(r)
    asked += (grammar_param,) if grammar_param else ()
    p = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if r.temperature is None else float(r.temperature),
        top_p=1.0 if r.top_p is None else float(r.top_p),
        top_k=max(0, r.top_k or 0),
        seed=seed,
        stop=_stop(r.stop, lim),
        stop_token_ids=_stop_ids(r.stop_token_ids, lim),
        ignore_eos=bool(r.ignore_eos),
        logprobs=logprobs,
        presence_penalty=r.presence_penalty or 0.0,
        frequency_penalty=r.frequency_penalty or 0.0,
        repetition_penalty=1.0 if r.repetition_penalty is None else r.repetition_penalty,
        min_tokens=min_tokens,
        logit_bias=dict(r.logit_bias or {}),
        grammar=grammar,
    )
    if not lim.logit_processors and p.needs_processed_steps:
        names = [*asked, *(min_tokens_name if f == "min_tokens" else f for f in _PROCESSOR_FIELDS
                           if getattr(p, f) != getattr(SamplingParams, f, None) and (f != "logit_bias" or p.logit_bias))]
        raise ApiError(f"{', '.join(map(repr, names))} {'is' if len(names) == 1 else 'are'} not supported by this "
                       "server: it runs without logit processors (--logit-processors off)", param=names[0])
    try:
        p.validate(vocab_size=lim.vocab_size)
    except InvalidRequestError as e:
        name = str(e).split(" ", 1)[0]
        raise ApiError(str(e).replace("min_tokens", min_tokens_name),
                       param=min_tokens_name if name == "min_tokens" else name) from None
    return p


def _prompts(p, name: str) -> tuple[list, bool]:
    """A prompt, or a batch of them -> (prompts, batched); each prompt non-empty."""
    if not (isinstance(p, list) and p and isinstance(p[0], (str, list))):
        if not p:
            raise ApiError(f"'{name}' is empty", param=name)
        return [p], False
    for i, q in enumerate(p):
        if not q:
            raise ApiError(f"'{name}[{i}]' is empty", param=name)
    return p, True


def _choices(n: int | None, num_prompts: int, lim: Limits, name: str = "n") -> int:
    n = 1 if n is None else n
    if n * num_prompts > lim.max_choices:
        what = f"{num_prompts} prompts x n = {n}" if num_prompts > 1 else f"n = {n}"
        raise ApiError(f"at most {lim.max_choices} choices per request, got {what}", param=name)
    return n


def _openai_common(r, lim: Limits, max_new_tokens: int, num_prompts: int, logprobs: int | None = None,
                   asked: tuple[str, ...] = (), engine_logprobs: int | None = None, per_prompt: int | None = None) -> dict:
    n = _choices(r.n, num_prompts, lim)
    if per_prompt is not None and per_prompt > n:
        _choices(per_prompt, num_prompts, lim, "best_of")
    elp = logprobs if engine_logprobs is None else engine_logprobs
    return {"params": _sampling(r, lim, max_new_tokens, r.seed, logprobs=elp, asked=asked), "n": n,
            "grammar_param": _grammar(r)[1],
            "stream": bool(r.stream), "include_usage": bool(r.stream_options and r.stream_options.include_usage),
            "spec_details": bool(r.return_spec_tokens_details), "model": r.model, "logprobs": logprobs}


def parse_completion(body: dict, lim: Limits) -> ParsedRequest:
    r: CompletionRequest = validate(CompletionRequest, body)
    prompts, batched = _prompts(r.prompt, "prompt")
    n = 1 if r.n is None else r.n
    best_of = None
    if r.best_of is not None and r.best_of != n:
        if r.best_of < n:
            raise ApiError(f"'best_of' must be >= n ({n}), got {r.best_of}", param="best_of")
        if r.stream:
            raise ApiError("'best_of' > n cannot be streamed (the best candidates are known only at the end)",
                           param="best_of")
        best_of = r.best_of
    if r.echo and r.logprobs is not None:
        raise ApiError("'logprobs' with 'echo' is not supported by this server (no prompt logprobs)", param="logprobs")
    asked = ("logprobs",) if r.logprobs is not None else ("best_of",) if best_of else ()
    # best_of ranks by cumulative logprob: the engine computes them even when not returned
    engine_lp = r.logprobs if r.logprobs is not None else (0 if best_of else None)
    common = _openai_common(r, lim, _max_tokens(r.max_tokens, 16, lim, "max_tokens"), len(prompts), r.logprobs,
                            asked, engine_lp, best_of)
    return ParsedRequest(prompts, batched=batched, echo=bool(r.echo), best_of=best_of, **common)


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
    if r.top_logprobs and not r.logprobs:
        raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    logprobs = (r.top_logprobs or 0) if r.logprobs else None
    return ParsedRequest([messages], **_openai_common(r, lim, max_new, 1, logprobs, ("logprobs",) if r.logprobs else ()),
                         max_tokens_given=given is not None)


def parse_generate(body: dict, lim: Limits) -> ParsedRequest:
    """SGLang /generate: {text | input_ids (one, or a batch), sampling_params{...}, stream}."""
    r: GenerateRequest = validate(GenerateRequest, body)
    if (r.text is None) == (r.input_ids is None):
        raise ApiError("give exactly one of 'text' and 'input_ids'", param="text")
    name = "text" if r.text is not None else "input_ids"
    prompts, batched = _prompts(getattr(r, name), name)
    sp = r.sampling_params or GenerateSamplingParams()
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise ApiError("'sampling_params.seed' and 'sampling_params.sampling_seed' differ", param="seed")
    seed = sp.seed if sp.seed is not None else sp.sampling_seed
    if r.top_logprobs_num and not r.return_logprob:
        raise ApiError("'top_logprobs_num' needs 'return_logprob': true", param="top_logprobs_num")
    logprobs = (r.top_logprobs_num or 0) if r.return_logprob else None
    params = _sampling(sp, lim, _max_tokens(sp.max_new_tokens, 128, lim, "max_new_tokens"), seed, logprobs=logprobs,
                       min_tokens_name="min_new_tokens", asked=("return_logprob",) if r.return_logprob else ())
    return ParsedRequest(prompts, params, n=_choices(sp.n, len(prompts), lim), batched=batched, stream=bool(r.stream),
                         logprobs=logprobs, grammar_param=_grammar(sp)[1])
