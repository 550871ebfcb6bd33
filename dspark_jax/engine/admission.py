"""What a request must pass before an engine queues it: its prompt encoded and checked against
the vocabulary and the context, its sampling parameters against what the engine runs.  Both run
off the engine thread in the server, so a bad request fails alone and a huge one stalls no one."""

from __future__ import annotations

import dataclasses

from dspark_jax.errors import InvalidRequestError
from dspark_jax.logit_processors import MAX_STOP_IDS
from dspark_jax.sampling import SamplingParams


def encode_prompt(prompt, tokenizer, vocab_size: int, max_len: int, lookahead: int) -> list[int]:
    """Token ids of a prompt (text, or ids), each in [0, vocab_size), leaving room in the context
    for one generated token and a lookahead-token draft block."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer: pass token ids")
        ids = tokenizer.encode(prompt)
    else:
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise InvalidRequestError("prompt must be a string or a list of integer token ids") from None
    if not ids:
        raise InvalidRequestError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(ids) + lookahead >= max_len:
        raise InvalidRequestError(
            f"prompt has {len(ids)} tokens; the context is {max_len}, which must also hold "
            f"at least one generated token{f' and a {lookahead}-token draft block' if lookahead else ''}")
    return ids


def check_params(params: SamplingParams | None, num_tokens: int, processors, grammars, eos_ids) -> SamplingParams:
    """A validated copy of params (default ones for None): ids within the real vocabulary
    (num_tokens), logit processors only where the engine has them (processors None: off), its
    grammar compiled for the engine's vocabulary width, and min_tokens' stop ids within the mask."""
    params = dataclasses.replace(params) if params else SamplingParams()
    params.validate(vocab_size=num_tokens)
    if params.needs_processed_steps and processors is None:
        raise InvalidRequestError("logprobs, penalties, logit_bias, min_tokens and structured output need an "
                                  "engine with logit processors (EngineConfig.logit_processors is 'off')")
    g = params.compiled_grammar
    if params.grammar is None:
        params.compiled_grammar = None
    elif g is None or g.key != tuple(params.grammar) or g.table.shape[1] != processors.vocab:
        # (compiled already, off the engine thread, where a server checked the request)
        params.compiled_grammar = grammars.compile(*params.grammar)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos and not params.grammar else set(eos_ids))
    if params.min_tokens and len(stops) > MAX_STOP_IDS:
        raise InvalidRequestError(f"min_tokens masks at most {MAX_STOP_IDS} stop and EOS ids; this request "
                                  f"has {len(stops)}")
    return params
