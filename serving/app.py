"""The FastAPI application: OpenAI-compatible and SGLang-style endpoints over an EngineLoop.

    app = create_app(engine, ServerConfig(model_name="m"), on_fatal=callback)

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (serving/openai_api.py),
POST /generate (serving/generate_api.py), GET /health, GET /metrics, GET /server_info (here).
Every error is an OpenAI-style body {"error": {"message", "type", "param", "code"}}, logged at
WARNING, and touches no other request.  A client that disconnects aborts its request (slot and
KV pages are freed at once).

A request is read within `max_body_bytes` (413), parsed within fixed bounds (serving/jsonbody.py),
validated (serving/protocol.py, serving/params.py), rendered and tokenized on a small thread pool,
and only then handed to the engine thread as token ids (serving/dispatch.py): nothing a client
sends is interpreted on that thread.  If the engine itself fails (engine.step() raises), every
request in flight gets a 500, /health answers 503 with the cause, and `on_fatal(error)` is called
so the process can exit non-zero.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import jax
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving import generate_api, openai_api
from serving.dispatch import error_response
from serving.engine_loop import describe
from serving.errors import ApiError, api_error_from_validation, internal_error
from serving.protocol import REQUEST_MODELS
from serving.state import ServerConfig, ServerState

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger("serving")


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
        state.close()

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
        return error_response(state, exc, request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = [{**e, "loc": tuple(e["loc"])[1:] if e["loc"] and e["loc"][0] == "body" else tuple(e["loc"])}
                  for e in exc.errors()]
        return error_response(state, api_error_from_validation(errors), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(state, ApiError(str(exc.detail), status=exc.status_code, headers=exc.headers,
                                              type="not_found_error" if exc.status_code == 404 else "invalid_request_error"), request)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(state, internal_error(exc), request)

    app.include_router(openai_api.router)
    app.include_router(generate_api.router)

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
            "vocab_size": engine.config.vocab_size, "max_body_bytes": cfg.max_body_bytes,
            "max_choices": cfg.max_choices, "device": _device(), "jax_version": jax.__version__,
            "draining": state.draining, "uptime_s": time.time() - state.started, "pid": os.getpid(),
            "memory_usage": {"token_capacity": snap["token_capacity"], "kv_used_pages": snap["kv_used_pages"],
                             "kv_free_pages": snap["kv_free_pages"], "kv_total_pages": snap["kv_total_pages"]},
            "tp_size": ec.tp_size, "dp_size": getattr(engine, "num_replicas", len(loops)),
            "internal_states": engine.replica_states() if hasattr(engine, "replica_states") else  # over hosts
                               [{**dict(lp.snapshot), "avg_spec_accept_length": avg_acc(lp.engine),
                                 **({"replica": i, **parallel(lp.engine)} if len(loops) > 1 else {})}
                                for i, lp in enumerate(loops)],
            **cfg.extra,
        }

    return app


def _device() -> str:
    d = jax.devices()[0]
    kind = getattr(d, "device_kind", d.platform)
    if d.platform != "cpu":
        return f"{kind} x{jax.device_count()}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU, {cores} cores"
