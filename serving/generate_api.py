"""SGLang's native endpoint: POST /generate.

    {"text": "..." | ["...", ...], "input_ids": [...] | [[...], ...], "sampling_params": {...}, "stream": bool}

One prompt with n = 1 answers one object {"text", "output_ids", "meta_info"}; a batch of prompts
or n > 1 answers a list of them, prompt-major (index = prompt_index * n + j).  A stream sends
cumulative text and ids per chunk; with several choices each chunk also names its "index".
With return_logprob, meta_info carries output_token_logprobs ([logprob, token id, None] per
token, SGLang's shape) and output_top_logprobs (top_logprobs_num of them per token), cumulative
like the text.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from serving.dispatch import Choices, compile_grammar, read_request, sse_response, state_of, tokenize
from serving.params import parse_generate
from serving.protocol import GenerateRequest, body_schema
from serving.responses import SSE_DONE, generate_item, sse

router = APIRouter()


def _lp(result):
    return (result.logprobs, result.top_logprobs) if result.logprobs is not None else None


@router.post("/generate", openapi_extra=body_schema(GenerateRequest))
async def generate(request: Request):
    state = state_of(request)
    parsed = parse_generate(await read_request(request, state), state.limits())
    param = "text" if isinstance(parsed.prompts[0], str) else "input_ids"
    prompt_ids = await tokenize(state, state.engine.encode_prompt, parsed.prompts, param=param, batched=parsed.batched)
    await compile_grammar(state, parsed)
    choices = await Choices.start(state, parsed.jobs(prompt_ids, state.max_model_len), "gen")
    many = parsed.batched or parsed.n > 1
    prompt_len = [len(ids) for ids in prompt_ids for _ in range(parsed.n)]
    if not parsed.stream:
        results = await choices.results(request)
        items = [generate_item(s.id, r.text, r.token_ids, prompt_len[i], r, _lp(r))
                 for i, (s, r) in enumerate(zip(choices.streams, results))]
        return items if many else items[0]

    async def gen():
        texts, ids = [""] * len(prompt_len), [[] for _ in prompt_len]
        lps = [([], []) for _ in prompt_len]
        async for i, delta, new_ids, lp, r in choices.deltas(parsed.params.stop):
            texts[i] += delta
            ids[i] = r.token_ids if r is not None else ids[i] + new_ids
            if lp is not None:
                lps[i] = (lps[i][0] + lp[0], lps[i][1] + lp[1])
            item = generate_item(choices.streams[i].id, texts[i], ids[i], prompt_len[i], r,
                                 (_lp(r) if r is not None else lps[i]) if parsed.logprobs is not None else None)
            yield sse({**item, "index": i} if many else item)
        yield SSE_DONE

    return sse_response(state, request, gen(), choices)
