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
- ``best_of``: accepted when it equals n; above n it would need log probabilities to rank the
  candidates, which the engine does not return yet, so it is refused.
- a batch of prompts (/v1/completions ``prompt``, /generate ``text`` / ``input_ids`` as a list):
  choice index = prompt_index * n + j (prompt-major, like vLLM); every prompt uses the same
  seeds, so a batch equals one request per prompt.  Usage sums over prompts (prompt tokens are
  counted once per prompt, not per choice).
- ``echo`` (/v1/completions): the prompt text is prepended to each choice's text.

At most `Limits.max_choices` engine requests per HTTP request (prompts x n).
"""

from __future__ import annotations

import dataclasses

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

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def jobs(self, prompt_ids: list[list[int]], max_model_len: int) -> list[tuple[list[int], SamplingParams]]:
        """One (token ids, params) per choice, in choice-index order (prompt-major)."""
        out = []
        for ids in prompt_ids:
            base = self.params
            if not self.max_tokens_given:  # the server's default, within the context the prompt leaves
                base = dataclasses.replace(base, max_new_tokens=max(1, min(base.max_new_tokens, max_model_len - len(ids))))
            for j in range(self.n):
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


def _openai_common(r, lim: Limits, max_new_tokens: int, num_prompts: int) -> dict:
    return {"params": _sampling(r, lim, max_new_tokens, r.seed), "n": _choices(r.n, num_prompts, lim),
            "stream": bool(r.stream), "include_usage": bool(r.stream_options and r.stream_options.include_usage),
            "spec_details": bool(r.return_spec_tokens_details), "model": r.model}


def parse_completion(body: dict, lim: Limits) -> ParsedRequest:
    r: CompletionRequest = validate(CompletionRequest, body)
    prompts, batched = _prompts(r.prompt, "prompt")
    common = _openai_common(r, lim, _max_tokens(r.max_tokens, 16, lim, "max_tokens"), len(prompts))
    if r.best_of is not None and r.best_of != common["n"]:
        if r.best_of < common["n"]:
            raise ApiError(f"'best_of' must be >= n ({common['n']}), got {r.best_of}", param="best_of")
        raise ApiError(f"'best_of' > n is not supported by this server: ranking {r.best_of} candidates to return the "
                       f"best {common['n']} needs log probabilities, which are not computed yet; send best_of = n "
                       "or leave it out", param="best_of")
    return ParsedRequest(prompts, batched=batched, echo=bool(r.echo), **common)


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
    return ParsedRequest([messages], **_openai_common(r, lim, max_new, 1), max_tokens_given=given is not None)


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
    params = _sampling(sp, lim, _max_tokens(sp.max_new_tokens, 128, lim, "max_new_tokens"), seed)
    return ParsedRequest(prompts, params, n=_choices(sp.n, len(prompts), lim), batched=batched, stream=bool(r.stream))
