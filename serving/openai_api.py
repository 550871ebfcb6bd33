"""OpenAI endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

Both generation endpoints run one engine request per choice (n per prompt; a batch of prompts
on /v1/completions), indexed prompt-major; see serving/params.py for what each parameter means.
A stream interleaves the choices' chunks as they come, each naming its `index`; with
``stream_options.include_usage`` one last chunk carries the usage of them all.  With logprobs
each choice (and each stream chunk, for its own tokens) carries OpenAI's logprobs object:
completions {tokens, token_logprobs, top_logprobs, text_offset}, chat {content: [...]}.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from dspark_jax.errors import InvalidRequestError
from serving.chat import render_chat
from serving.dispatch import Choices, check_model, compile_grammar, read_request, sse_response, state_of, tokenize
from serving.params import ParsedRequest, parse_chat, parse_completion
from serving.protocol import ChatCompletionRequest, CompletionRequest, body_schema
from serving.responses import (
    SSE_DONE,
    ChatShape,
    CompletionShape,
    TokenTexts,
    cumulative_logprob,
    now,
    spec_ext,
    sse,
    usage,
)

router = APIRouter()


async def _serve(request: Request, parsed: ParsedRequest, prompt_ids: list[list[int]], shape, echo: list[str]):
    """Run every choice of a parsed completion or chat request; answer in `shape`."""
    state, n, per = state_of(request), parsed.n, parsed.per_prompt
    await compile_grammar(state, parsed)
    choices = await Choices.start(state, parsed.jobs(prompt_ids, state.max_model_len), shape.prefix)
    base = {"id": choices.id, "created": now(), "model": state.cfg.model_name}
    prompt_tokens = sum(len(ids) for ids in prompt_ids)  # once per prompt, not per choice
    # usage counts every engine request (best_of candidates too); spec details the choices returned
    totals = lambda results, kept: {"usage": usage(prompt_tokens, sum(len(r.token_ids) for r in results)),
                                    **(spec_ext(kept) if parsed.spec_details else {})}
    texts = TokenTexts(state.engine.tokenizer)
    want_lp = parsed.logprobs is not None
    if not parsed.stream:
        results = await choices.results(request)
        kept = results
        if per > n:  # best_of: the n candidates of each prompt with the highest cumulative logprob, best first
            kept = [r for p in range(len(prompt_ids))
                    for r in sorted(results[p * per:(p + 1) * per], key=cumulative_logprob, reverse=True)[:n]]
        lp = lambda r: shape.logprobs(texts, r.token_ids, r.logprobs, r.top_logprobs)[0] if want_lp else None
        return {**base, "object": shape.object, **totals(results, kept),
                "choices": [shape.choice(i, r, echo[i // n], lp(r)) for i, r in enumerate(kept)]}

    async def gen():
        head = {**base, "object": shape.chunk_object}
        extra = {"usage": None} if parsed.include_usage else {}
        for i in range(parsed.num_choices):
            if (opening := shape.opening(i, echo[i // n])) is not None:
                yield sse({**head, "choices": [opening], **extra})
        results = [None] * parsed.num_choices
        offsets = [len(e) for e in echo for _ in range(n)]
        async for i, text, ids, lp, r in choices.deltas(parsed.params.stop):
            if r is None and not text and lp is None:
                continue
            results[i] = r
            obj = None
            if want_lp and lp is not None:
                obj, offsets[i] = shape.logprobs(texts, ids, lp[0], lp[1], offsets[i])
            yield sse({**head, "choices": [shape.delta(i, text, r.finish_reason if r else None, obj)], **extra})
        if parsed.include_usage:
            yield sse({**head, "choices": [], **totals(results, results)})
        yield SSE_DONE

    return sse_response(state, request, gen(), choices)


def _prompt_text(engine, prompt) -> str:  # tokenize pool: what echo prepends (ids already checked)
    if isinstance(prompt, str):
        return prompt
    if engine.tokenizer is None:
        raise InvalidRequestError("echo of token ids needs a tokenizer, and this engine has none")
    return engine.tokenizer.decode(prompt)


@router.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
async def completions(request: Request):
    state = state_of(request)
    parsed = parse_completion(await read_request(request, state), state.limits())
    check_model(state, parsed.model)
    engine, batched = state.engine, parsed.batched
    ids = await tokenize(state, engine.encode_prompt, parsed.prompts, param="prompt", batched=batched)
    echo = [""] * len(ids)
    if parsed.echo:
        echo = await tokenize(state, lambda p: _prompt_text(engine, p), parsed.prompts, param="prompt", batched=batched)
    return await _serve(request, parsed, ids, CompletionShape, echo)


def _special_tokens(tok) -> dict:
    """eos token string for chat templates that print it (HF passes it too).

    bos_token stays "": Tokenizer.encode already prepends bos when the model asks for one, so a
    template that prints it would double it."""
    return {"bos_token": "", "eos_token": (tok.eos_token if tok is not None else None) or ""}


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat_completions(request: Request):
    state = state_of(request)
    parsed = parse_chat(await read_request(request, state), state.limits(), state.cfg.default_chat_max_tokens)
    check_model(state, parsed.model)
    engine = state.engine

    def chat_prompt_ids(messages: list[dict]) -> list[int]:  # tokenize pool
        tok = engine.tokenizer
        return engine.encode_prompt(render_chat(messages, getattr(tok, "chat_template", None), **_special_tokens(tok)))

    ids = await tokenize(state, chat_prompt_ids, parsed.prompts, param="messages")
    return await _serve(request, parsed, ids, ChatShape, [""])


@router.get("/v1/models")
async def models(request: Request):
    state = state_of(request)
    cfg = state.cfg
    return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": int(state.started),
                                        "owned_by": "dspark-jax", "root": cfg.model_path,
                                        "max_model_len": state.max_model_len}]}
