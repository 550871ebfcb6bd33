"""The path of one generation request to the engine and back, shared by every endpoint.

    body = await read_request(request, state)              # 503 when not serving, 413, 400
    ids = await tokenize(state, fn, prompts, param="prompt")  # on the tokenize pool
    await compile_grammar(state, parsed)                     # structured output, on the tokenize pool
    choices = await Choices.start(state, jobs, "cmpl")      # every engine request queued, or an error
    results = await choices.results(request)                # non-streaming
    async for index, text, new_ids, lp, result in choices.deltas(stops): ...   # streaming
    return sse_response(state, request, gen, choices)

One HTTP request may stand for several engine requests (n choices, a batch of prompts): they
are queued together, answered together, and aborted together when the client goes away or any
of them fails.  Nothing here runs on the engine thread.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dspark_jax.errors import InvalidRequestError
from serving.chat import ChatTemplateError
from serving.engine_loop import describe
from serving.errors import ApiError, api_error_of, internal_error, short
from serving.jsonbody import parse_json_body, read_body
from serving.responses import SSE_DONE, TextDeltas, sse
from serving.state import ServerState

log = logging.getLogger("serving")


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def check_serving(state: ServerState) -> None:
    if state.loop.error is not None:
        raise ApiError(f"the engine failed ({describe(state.loop.error)}); the server must be restarted",
                       status=503, type="unavailable")
    if state.draining:
        raise ApiError("the server is shutting down", status=503, type="unavailable")


def check_model(state: ServerState, model: str | None) -> None:
    cfg = state.cfg
    if model is not None and model not in (cfg.model_name, cfg.model_path):
        raise ApiError(f"model {short(model)} is not served here; GET /v1/models lists {short(cfg.model_name)}",
                       status=404, param="model", type="invalid_request_error", code="model_not_found")


async def read_request(request: Request, state: ServerState) -> dict:
    check_serving(state)
    return parse_json_body(await read_body(request, state.cfg.max_body_bytes))


async def tokenize(state: ServerState, fn, prompts: list, *, param: str, batched: bool = False) -> list:
    """fn(prompt) for every prompt on the tokenize pool (chat rendering, tokenization); an error
    is this request's, naming the prompt of a batch it came from."""
    loop = asyncio.get_running_loop()
    out = await asyncio.gather(*(loop.run_in_executor(state.tokenize_pool, fn, p) for p in prompts),
                               return_exceptions=True)
    for i, r in enumerate(out):
        where = f"'{param}[{i}]': " if batched else ""
        if isinstance(r, InvalidRequestError):
            raise ApiError(where + str(r), param=param)
        if isinstance(r, ChatTemplateError):
            raise ApiError(str(r), param="messages")
        if isinstance(r, BaseException):
            log.error("preparing the prompt failed", exc_info=r)
            raise internal_error(r, "internal error while tokenizing the prompt")
    return out


async def compile_grammar(state: ServerState, parsed) -> None:
    """Compile a structured-output request's grammar on the tokenize pool (the engine thread then
    finds it compiled); an invalid or too large grammar is a 400 naming its parameter."""
    if parsed.params.grammar is None:
        return
    loop = asyncio.get_running_loop()
    try:
        parsed.params = await loop.run_in_executor(state.tokenize_pool, state.engine.check_params, parsed.params)
    except InvalidRequestError as e:
        raise ApiError(f"'{parsed.grammar_param}': {e}", param=parsed.grammar_param) from None


class Choices:
    """The engine requests behind one HTTP request, in choice-index order, read as one event queue."""

    def __init__(self, state: ServerState, streams: list, queue: asyncio.Queue):
        self.state, self.streams, self.queue = state, streams, queue
        self._early: collections.deque = collections.deque()  # events read while waiting for admission

    @classmethod
    async def start(cls, state: ServerState, jobs: list, prefix: str) -> Choices:
        """Queue one engine request per (token ids, params) job; returns once the engine took every
        one.  If it refuses any (or the client leaves first), all are aborted and the error raised."""
        check_serving(state)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        self = cls(state, [state.loop.submit(ids, params, loop, prefix, queue, i) for i, (ids, params)
                           in enumerate(jobs)], queue)
        try:
            waiting = len(jobs)
            while waiting:
                stream, ev = self._take(await queue.get())
                if ev[0] == "error":
                    raise api_error_of(ev[1])
                if ev[0] == "accepted":
                    waiting -= 1
                else:  # a choice already running while a later one was being queued
                    self._early.append((stream, ev))
        except BaseException:
            self.abort()
            raise
        return self

    @property
    def id(self) -> str:
        return self.streams[0].id

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    @staticmethod
    def _take(item: tuple) -> tuple:
        stream, ev = item
        if ev[0] in ("done", "error"):
            stream.finished = True
        return item

    async def next(self) -> tuple[int, tuple]:
        """(choice index, ("delta", ids, text, lp) or ("done", result)) of whichever choice moves
        next; an error event raises the ApiError it means."""
        while True:
            stream, ev = self._early.popleft() if self._early else self._take(await self.queue.get())
            if ev[0] == "error":
                raise api_error_of(ev[1])
            if ev[0] != "accepted":
                return stream.index, ev

    def abort(self) -> None:
        for s in self.streams:
            if not s.finished:
                self.state.loop.abort(s.id)

    async def results(self, request: Request) -> list:
        """Non-streaming: every choice's GenerationResult; a client that disconnects aborts them."""

        async def watch():
            while True:
                if (await request.receive())["type"] == "http.disconnect":
                    log.info("client disconnected: aborting %s", self.id)
                    self.abort()
                    return

        watcher = asyncio.create_task(watch())
        out, left = [None] * len(self.streams), len(self.streams)
        try:
            while left:
                i, ev = await self.next()
                if ev[0] == "done":
                    out[i], left = ev[1], left - 1
            return out
        finally:
            watcher.cancel()
            self.abort()

    async def deltas(self, stops):
        """Streaming: yields (index, text delta, new ids, their (logprobs, top logprobs) or None,
        result or None) until every choice is done."""
        texts, left = [TextDeltas(stops) for _ in self.streams], len(self.streams)
        while left:
            i, ev = await self.next()
            if ev[0] == "delta":
                yield i, texts[i].update(ev[2]), ev[1], ev[3], None
            else:
                left -= 1
                yield i, texts[i].final(ev[1].text), [], None, ev[1]


def error_response(state: ServerState | None, err: ApiError, request: Request | None = None) -> JSONResponse:
    where = f"{request.method} {request.url.path}" if request is not None else ""
    log.warning("%s -> %d: %s", where, err.status, err.message[:500])
    if state is not None:
        state.metrics.http_errors.labels(status=str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def sse_response(state: ServerState, request: Request, gen, choices: Choices) -> StreamingResponse:
    """Server-sent events from `gen`.  After the 200 has gone out an error ends the stream with an
    OpenAI-style error event; however the stream ends, choices still running are aborted."""

    async def guarded():
        try:
            async for chunk in gen:
                yield chunk
        except Exception as exc:  # noqa: BLE001 - this stream only
            if not isinstance(exc, ApiError):
                log.exception("internal error in the %s stream", request.url.path)
            e = exc if isinstance(exc, ApiError) else internal_error(exc)
            log.warning("%s %s -> %d mid-stream: %s", request.method, request.url.path, e.status, e.message[:500])
            state.metrics.http_errors.labels(status=str(e.status)).inc()
            yield sse(e.body())
            yield SSE_DONE
        finally:
            if not choices.finished:  # the client went away, or an error ended the stream early
                log.info("stream %s closed early: aborting what still runs", choices.id)
                choices.abort()

    return StreamingResponse(guarded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
