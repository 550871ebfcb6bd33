"""The FastAPI application: OpenAI-compatible and SGLang-style endpoints over an EngineLoop.

    app = create_app(engine, ServerConfig(model_name="m"), on_fatal=callback)

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /generate,
GET /health, GET /metrics, GET /server_info.  Every error is an OpenAI-style body
{"error": {"message", "type", "param", "code"}}, logged at WARNING, and touches no other request.
A client that disconnects aborts its request (slot and KV pages are freed at once).

A request is read within `max_body_bytes` (413), parsed within fixed bounds (serving/jsonbody.py),
validated (serving/protocol.py), rendered and tokenized on a small thread pool, and only then
handed to the engine thread as token ids: nothing a client sends is interpreted on that thread.
If the engine itself fails (engine.step() raises), every request in flight gets a 500, /health
answers 503 with the cause, and `on_fatal(error)` is called so the process can exit non-zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_jax.errors import InvalidRequestError
from serving.chat import ChatTemplateError, render_chat
from serving.engine_loop import (
    EngineDeadError,
    EngineLoop,
    RequestFailedError,
    RequestStream,
    ServerStoppingError,
    describe,
)
from serving.jsonbody import parse_json_body, read_body
from serving.metrics import ServerMetrics
from serving.protocol import (
    REQUEST_MODELS,
    SSE_DONE,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    Limits,
    ParsedRequest,
    api_error_from_validation,
    now,
    parse_chat,
    parse_completion,
    parse_generate,
    short,
    spec_fields,
    sse,
    usage,
)
from serving.replicas import ReplicaRouter

log = logging.getLogger("serving")

TOKENIZE_WORKERS = 2  # chat rendering + tokenization, off the event loop and off the engine thread


@dataclasses.dataclass
class ServerConfig:
    model_name: str = "default"
    model_path: str | None = None
    draft_model_path: str | None = None
    speculative_algorithm: str = "NONE"
    verify_mode: str | None = None
    block_size: int | None = None
    shutdown_timeout: float = 30.0  # SIGTERM: how long in-flight requests may run before abort
    max_body_bytes: int = 4 << 20  # larger request bodies get a 413
    default_chat_max_tokens: int = 1024  # chat without max_tokens: this, capped by the context left
    max_stop_strings: int = 16  # per request
    max_stop_chars: int = 256  # per stop string
    extra: dict = dataclasses.field(default_factory=dict)  # more fields for /server_info


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


class ServerState:
    """Everything the endpoints share.  `on_fatal(error)`, if set, is called once from the engine
    thread after a fatal engine error, once every request in flight has been answered; by then
    `fatal_error` holds the error and `fatal_event` is set."""

    def __init__(self, engine, cfg: ServerConfig, on_fatal: Callable[[BaseException], None] | None = None):
        engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]  # data-parallel replicas
        self.engine = engines[0]  # every replica has the same model and limits
        self.cfg = cfg
        self.metrics = ServerMetrics(cfg.model_name, speculative=cfg.speculative_algorithm != "NONE")
        self.on_fatal = on_fatal
        self.fatal_error: BaseException | None = None
        self.fatal_event = threading.Event()
        self.loop = (EngineLoop(engines[0], self.metrics, on_fatal=self._fatal) if len(engines) == 1 else
                     ReplicaRouter(engines, self.metrics, on_fatal=self._fatal))
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_WORKERS, thread_name_prefix="dspark-tokenize")
        self.draining = False
        self.started = time.time()
        self._drain_timer: threading.Timer | None = None

    def _fatal(self, err: BaseException) -> None:
        self.fatal_error = err
        self.fatal_event.set()
        log.critical("engine failed (%s): the server cannot serve any more requests", describe(err))
        if self.on_fatal is not None:
            self.on_fatal(err)

    def begin_drain(self, timeout: float | None = None) -> None:
        """Stop taking new requests; abort whatever still runs after `timeout` seconds."""
        if self.draining:
            return
        self.draining = True
        t = self.cfg.shutdown_timeout if timeout is None else timeout
        log.info("draining: no new requests; in-flight ones get %.1f s before they are aborted", t)
        self._drain_timer = threading.Timer(t, self.loop.abort_all)
        self._drain_timer.daemon = True
        self._drain_timer.start()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def limits(self) -> Limits:
        return Limits(max_model_len=self.engine.max_model_len, vocab_size=self.engine.config.vocab_size,
                      max_stop_strings=self.cfg.max_stop_strings, max_stop_chars=self.cfg.max_stop_chars)


def api_error_of(exc: BaseException) -> ApiError:
    """An engine-loop error event -> the HTTP error it means."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return ApiError(str(exc))
    if isinstance(exc, ServerStoppingError):
        return ApiError(str(exc), status=503, type="unavailable")
    if isinstance(exc, (EngineDeadError, RequestFailedError)):
        return ApiError(str(exc), status=500, type="internal_error")
    return ApiError(f"internal error: {describe(exc)}", status=500, type="internal_error")


def _error_response(state: ServerState | None, err: ApiError, request: Request | None = None) -> JSONResponse:
    where = f"{request.method} {request.url.path}" if request is not None else ""
    log.warning("%s -> %d: %s", where, err.status, err.message[:500])
    if state is not None:
        state.metrics.http_errors.labels(status=str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _body_schema(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def create_app(engine, cfg: ServerConfig | None = None, *,
               on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    cfg = cfg or ServerConfig()
    state = ServerState(engine, cfg, on_fatal)
    engine = state.engine  # (the first replica's, with data parallelism)

    @asynccontextmanager
    async def lifespan(app):
        if not state.loop.thread.is_alive() and not state.loop.thread.ident:
            state.loop.start()
        yield
        state.draining = True
        state.loop.stop()
        if state._drain_timer:
            state._drain_timer.cancel()
        state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dspark-jax", lifespan=lifespan)
    app.state.server = state

    def openapi() -> dict:
        """FastAPI's schema plus the request models (bodies are parsed by hand, within bounds)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in REQUEST_MODELS:
                js = m.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[m.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error_response(state, exc, request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = [{**e, "loc": tuple(e["loc"])[1:] if e["loc"] and e["loc"][0] == "body" else tuple(e["loc"])}
                  for e in exc.errors()]
        return _error_response(state, api_error_from_validation(errors), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(state, ApiError(str(exc.detail), status=exc.status_code, headers=exc.headers,
                                               type="not_found_error" if exc.status_code == 404 else "invalid_request_error"), request)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return _error_response(state, ApiError(f"internal error: {describe(exc)}", status=500, type="internal_error"), request)

    # -- helpers ------------------------------------------------------------------------------
    def check_serving() -> None:
        if state.loop.error is not None:
            raise ApiError(f"the engine failed ({describe(state.loop.error)}); the server must be restarted",
                           status=503, type="unavailable")
        if state.draining:
            raise ApiError("the server is shutting down", status=503, type="unavailable")

    def check_model(model: str | None) -> None:
        if model is not None and model not in (cfg.model_name, cfg.model_path):
            raise ApiError(f"model {short(model)} is not served here; GET /v1/models lists {short(cfg.model_name)}",
                           status=404, param="model", type="invalid_request_error", code="model_not_found")

    async def body_of(request: Request) -> dict:
        check_serving()
        return parse_json_body(await read_body(request, cfg.max_body_bytes))

    async def off_thread(fn, *args, param: str | None):
        """Run prompt rendering / tokenization on the tokenize pool; its errors are this request's."""
        try:
            return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, fn, *args)
        except InvalidRequestError as e:
            raise ApiError(str(e), param=param) from None
        except ChatTemplateError as e:
            raise ApiError(str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - fails this request only
            log.exception("preparing the prompt failed")
            raise ApiError(f"internal error while tokenizing the prompt: {describe(e)}", status=500,
                           type="internal_error") from None

    async def start(ids: list[int], params, prefix: str) -> tuple[RequestStream, dict]:
        check_serving()
        stream = state.loop.submit(ids, params, asyncio.get_running_loop(), prefix)
        try:
            ev = await stream.get()
        except asyncio.CancelledError:  # client gone before the engine took the request
            state.loop.abort(stream.id)
            raise
        if ev[0] == "error":
            raise api_error_of(ev[1])
        return stream, ev[1]

    async def run_to_end(request: Request, stream: RequestStream):
        """Non-streaming: wait for "done", aborting the request if the client goes away."""

        async def watch():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    log.info("client disconnected: aborting %s", stream.id)
                    state.loop.abort(stream.id)
                    return

        watcher = asyncio.create_task(watch())
        try:
            while True:
                ev = await stream.get()
                if ev[0] == "done":
                    return ev[1]
                if ev[0] == "error":
                    raise api_error_of(ev[1])
        finally:
            watcher.cancel()
            if not stream.finished:
                state.loop.abort(stream.id)

    async def events(stream: RequestStream, stops):
        """Streaming: yields (text delta, new ids, result or None); aborts on cancellation."""
        deltas = TextDeltas(stops)
        try:
            while True:
                ev = await stream.get()
                if ev[0] == "delta":
                    d = deltas.update(ev[2])
                    yield d, ev[1], None
                elif ev[0] == "done":
                    yield deltas.final(ev[1].text), [], ev[1]
                    return
                elif ev[0] == "error":
                    raise api_error_of(ev[1])
        finally:
            if not stream.finished:  # client went away (task cancelled) or generator closed early
                log.info("stream %s closed by the client: aborting", stream.id)
                state.loop.abort(stream.id)

    def spec_ext(parsed: ParsedRequest, result) -> dict:
        if parsed.spec_details:
            return {"sglext": {"spec_tokens_details": spec_fields(result)}}
        return {}

    def sse_response(request: Request, gen) -> StreamingResponse:
        async def guarded():
            # After the 200 has gone out, an error ends the stream with an OpenAI-style error event.
            try:
                async for chunk in gen:
                    yield chunk
            except Exception as exc:  # noqa: BLE001 - this stream only
                e = exc if isinstance(exc, ApiError) else ApiError(f"internal error: {describe(exc)}", status=500,
                                                                    type="internal_error")
                if not isinstance(exc, ApiError):
                    log.exception("internal error in the %s stream", request.url.path)
                log.warning("%s %s -> %d mid-stream: %s", request.method, request.url.path, e.status, e.message[:500])
                state.metrics.http_errors.labels(status=str(e.status)).inc()
                yield sse(e.body())
                yield SSE_DONE

        return StreamingResponse(guarded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # -- OpenAI -------------------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        parsed = parse_completion(await body_of(request), state.limits())
        check_model(parsed.model)
        ids = await off_thread(engine.encode_prompt, parsed.prompt, param="prompt")
        stream, info = await start(ids, parsed.params, "cmpl")
        created, model = now(), cfg.model_name
        if not parsed.stream:
            r = await run_to_end(request, stream)
            return {
                "id": stream.id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}],
                "usage": usage(len(r.prompt_token_ids), len(r.token_ids)), **spec_ext(parsed, r),
            }

        async def gen():
            base = {"id": stream.id, "object": "text_completion", "created": created, "model": model}
            extra = {"usage": None} if parsed.include_usage else {}
            async for text, _ids, r in events(stream, parsed.params.stop):
                if r is None and not text:
                    continue
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": r.finish_reason if r else None}
                yield sse({**base, "choices": [choice], **extra})
                if r is not None:
                    if parsed.include_usage:
                        yield sse({**base, "choices": [], "usage": usage(len(r.prompt_token_ids), len(r.token_ids)),
                                   **spec_ext(parsed, r)})
            yield SSE_DONE

        return sse_response(request, gen())

    def chat_prompt_ids(messages: list[dict]) -> list[int]:  # tokenize pool
        tok = engine.tokenizer
        prompt = render_chat(messages, getattr(tok, "chat_template", None), **_special_tokens(tok))
        return engine.encode_prompt(prompt)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        parsed = parse_chat(await body_of(request), state.limits(), cfg.default_chat_max_tokens)
        check_model(parsed.model)
        ids = await off_thread(chat_prompt_ids, parsed.messages, param="messages")
        params = parsed.params
        if not parsed.max_tokens_given:  # the default, within the context the prompt leaves
            params = dataclasses.replace(params, max_new_tokens=max(1, min(params.max_new_tokens,
                                                                           state.max_model_len - len(ids))))
        stream, info = await start(ids, params, "chatcmpl")
        created, model = now(), cfg.model_name
        if not parsed.stream:
            r = await run_to_end(request, stream)
            return {
                "id": stream.id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                             "logprobs": None, "finish_reason": r.finish_reason}],
                "usage": usage(len(r.prompt_token_ids), len(r.token_ids)), **spec_ext(parsed, r),
            }

        async def gen():
            base = {"id": stream.id, "object": "chat.completion.chunk", "created": created, "model": model}
            extra = {"usage": None} if parsed.include_usage else {}
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield sse({**base, "choices": [first], **extra})
            async for text, _ids, r in events(stream, parsed.params.stop):
                if r is None and not text:
                    continue
                choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                          "finish_reason": r.finish_reason if r else None}
                yield sse({**base, "choices": [choice], **extra})
                if r is not None and parsed.include_usage:
                    yield sse({**base, "choices": [], "usage": usage(len(r.prompt_token_ids), len(r.token_ids)),
                               **spec_ext(parsed, r)})
            yield SSE_DONE

        return sse_response(request, gen())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "dspark-jax", "root": cfg.model_path,
                                            "max_model_len": state.max_model_len}]}

    # -- SGLang ---------------------------------------------------------------------------------
    def meta_info(rid, r, prompt_tokens, ids_count, finish) -> dict:
        m = {"id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": ids_count,
             "finish_reason": {"type": finish} if finish else None}
        if r is not None:
            m.update(spec_fields(r))
            m["e2e_latency"] = r.stats.get("latency_s")
        return m

    @app.post("/generate", openapi_extra=_body_schema(GenerateRequest))
    async def generate(request: Request):
        parsed = parse_generate(await body_of(request), state.limits())
        ids = await off_thread(engine.encode_prompt, parsed.prompt,
                               param="text" if isinstance(parsed.prompt, str) else "input_ids")
        stream, info = await start(ids, parsed.params, "gen")
        if not parsed.stream:
            r = await run_to_end(request, stream)
            return {"text": r.text, "output_ids": r.token_ids,
                    "meta_info": meta_info(stream.id, r, len(r.prompt_token_ids), len(r.token_ids), r.finish_reason)}

        async def gen():
            text, ids = "", []
            async for d, new_ids, r in events(stream, parsed.params.stop):
                text += d
                ids += new_ids
                if r is not None:
                    ids = r.token_ids
                yield sse({"text": text, "output_ids": ids,
                           "meta_info": meta_info(stream.id, r, info["prompt_tokens"], len(ids), r.finish_reason if r else None)})
            yield SSE_DONE

        return sse_response(request, gen())

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            err = state.loop.error
            return JSONResponse({"status": "engine failed" if err is not None else "engine not running",
                                 "error": describe(err) if err is not None else None}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/server_info")
    async def server_info():
        snap = dict(state.loop.snapshot)
        ec = engine.ec
        loops = getattr(state.loop, "loops", [state.loop])  # one per data-parallel replica

        def avg_acc(e):
            st = getattr(e, "stats", None)
            if isinstance(st, dict) and st.get("accept_lens"):
                return float(sum(st["accept_lens"]) / len(st["accept_lens"]))
            return None

        def parallel(e) -> dict:
            par = getattr(e, "parallel", None)
            return par.describe() if par is not None else {}
        return {
            "model_path": cfg.model_path, "served_model_name": cfg.model_name,
            "draft_model_path": cfg.draft_model_path, "speculative_algorithm": cfg.speculative_algorithm,
            "verify_mode": cfg.verify_mode, "block_size": cfg.block_size,
            "max_running_requests": ec.max_running_requests, "max_model_len": state.max_model_len,
            "page_size": engine.pool.page_size, "num_pages": engine.pool.num_pages,
            "max_prefill_tokens": ec.max_prefill_tokens, "compile_seconds": getattr(engine, "compile_seconds", None),
            "draining": state.draining, "uptime_s": time.time() - state.started,
            "memory_usage": {"token_capacity": snap["token_capacity"], "kv_used_pages": snap["kv_used_pages"],
                             "kv_free_pages": snap["kv_free_pages"], "kv_total_pages": snap["kv_total_pages"]},
            "tp_size": ec.tp_size, "dp_size": len(loops),
            "internal_states": [{**dict(lp.snapshot), "avg_spec_accept_length": avg_acc(lp.engine),
                                 **({"replica": i, **parallel(lp.engine)} if len(loops) > 1 else {})}
                                for i, lp in enumerate(loops)],
            **cfg.extra,
        }

    return app


def _special_tokens(tok) -> dict:
    """eos token string for chat templates that print it (HF passes it too).

    bos_token stays "": Tokenizer.encode already prepends bos when the model asks for one, so a
    template that prints it would double it."""
    return {"bos_token": "", "eos_token": (tok.eos_token if tok is not None else None) or ""}
