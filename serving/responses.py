"""Response shapes: OpenAI completion / chat bodies and stream chunks, SGLang /generate items,
usage, the SSE framing, and stream text deltas that never show part of a stop string."""

from __future__ import annotations

import json
import time

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace") + b"\n\n"


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


def spec_ext(results: list) -> dict:
    """sglext.spec_tokens_details: one object for one choice, else a list in choice order."""
    details = [spec_fields(r) for r in results]
    return {"sglext": {"spec_tokens_details": details[0] if len(details) == 1 else details}}


class TextDeltas:
    """Turns the growing request text into stream deltas that never show part of a stop string.

    The engine cuts a stop string (and what follows) from the final text; any suffix of the
    text that could still grow into a stop string is held back until the next step decides."""

    def __init__(self, stops=()):
        self.stops = tuple(stops)
        self.sent = 0

    def update(self, text: str) -> str:
        end = len(text)
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end -= hold
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta

    def final(self, text: str) -> str:
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta


# -- logprobs ----------------------------------------------------------------------------------

class TokenTexts:
    """Token id -> its text, decoded alone (special tokens kept), cached for one response."""

    def __init__(self, tokenizer):
        self.tok, self._cache = tokenizer, {}

    def __call__(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self._cache[tid] = (self.tok.decode([tid], skip_special_tokens=False) if self.tok is not None
                                    else f"<{tid}>")
        return s

    def completion(self, ids, lps, tops, offset: int = 0) -> tuple[dict, int]:
        """OpenAI completions logprobs of tokens whose text starts at `offset` -> (object, end offset).
        top_logprobs holds the top k and the chosen token (up to k + 1 entries, as OpenAI)."""
        tokens = [self(t) for t in ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        top = [{**{self(t): v for t, v in alts}, tokens[i]: lps[i]} for i, alts in enumerate(tops)]
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}, offset

    def _entry(self, tid: int, lp: float) -> dict:
        s = self(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    def chat(self, ids, lps, tops) -> dict:
        """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
        return {"content": [{**self._entry(t, lp), "top_logprobs": [self._entry(a, v) for a, v in alts]}
                            for t, lp, alts in zip(ids, lps, tops)]}


def cumulative_logprob(result) -> float:
    return float(sum(result.logprobs or ()))


# -- OpenAI ------------------------------------------------------------------------------------

class CompletionShape:
    """/v1/completions: choices carry `text`; with echo the prompt text comes first."""

    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    @staticmethod
    def choice(index: int, result, echo: str = "", logprobs: dict | None = None) -> dict:
        return {"index": index, "text": echo + result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}

    @staticmethod
    def delta(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def logprobs(texts: TokenTexts, ids, lps, tops, offset: int = 0) -> tuple[dict, int]:
        return texts.completion(ids, lps, tops, offset)

    @classmethod
    def opening(cls, index: int, echo: str = "") -> dict | None:
        return cls.delta(index, echo, None) if echo else None


class ChatShape:
    """/v1/chat/completions: choices carry a `message`; a stream opens each choice with the role."""

    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(index: int, result, echo: str = "", logprobs: dict | None = None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": result.text}, "logprobs": logprobs,
                "finish_reason": result.finish_reason}

    @staticmethod
    def delta(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": finish}

    @staticmethod
    def logprobs(texts: TokenTexts, ids, lps, tops, offset: int = 0) -> tuple[dict, int]:
        return texts.chat(ids, lps, tops), offset

    @staticmethod
    def opening(index: int, echo: str = "") -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


# -- SGLang /generate --------------------------------------------------------------------------

def generate_item(rid: str, text: str, ids: list[int], prompt_tokens: int, result=None, lp=None) -> dict:
    """One /generate answer (or stream chunk): text and ids so far, meta_info; `result` once done;
    lp: the (logprobs, top logprobs) of `ids` when the request asked (return_logprob), given as
    SGLang's output_token_logprobs [[logprob, id, None], ...] and output_top_logprobs."""
    finish = result.finish_reason if result is not None else None
    meta = {"id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
            "finish_reason": {"type": finish} if finish else None}
    if lp is not None:
        lps, tops = lp
        meta["output_token_logprobs"] = [[v, t, None] for t, v in zip(ids, lps)]
        meta["output_top_logprobs"] = [[[v, a, None] for a, v in alts] for alts in tops]
    if result is not None:
        meta.update(spec_fields(result))
        meta["e2e_latency"] = result.stats.get("latency_s")
    return {"text": text, "output_ids": ids, "meta_info": meta}
