"""HTTP errors: `ApiError` (an OpenAI-style error body and its status), and what pydantic
validation errors and engine-loop error events mean as HTTP errors.

Every error body is ``{"error": {"message", "type", "param", "code"}}``; a 4xx names the
parameter at fault in ``param`` where there is one.
"""

from __future__ import annotations

import json

from dspark_jax.errors import InvalidRequestError
from serving.engine_loop import EngineDeadError, RequestFailedError, ServerStoppingError, describe


class ApiError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type
        self.code = code if code is not None else status
        self.headers = headers

    def body(self) -> dict:
        # A message may quote request text: never let a lone surrogate break the response itself.
        clean = lambda s: s.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(s, str) else s
        return {"error": {"message": clean(self.message), "type": self.type, "param": clean(self.param), "code": self.code}}


def internal_error(exc: BaseException, what: str = "internal error") -> ApiError:
    return ApiError(f"{what}: {describe(exc)}", status=500, type="internal_error")


def short(v, n: int = 60) -> str:
    """A value for an error message: ASCII JSON, cut to about n characters."""
    try:
        r = json.dumps(v)
    except (TypeError, ValueError):
        r = ascii(v)
    return r if len(r) <= n else r[: n - 3] + "..."


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
    return internal_error(exc)


# -- pydantic validation errors --------------------------------------------------------------------

# Union-typed fields: pydantic reports one error per union member; one plain sentence instead.
_UNION_MESSAGES = {
    "prompt": "must be a non-empty string or list of token ids, or a list of either (a batch of prompts)",
    "text": "must be a non-empty string or a list of strings (a batch)",
    "input_ids": "must be a non-empty list of token ids or a list of such lists (a batch)",
    "stop": "must be a string or a list of strings",
    "content": 'must be a string or a list of text parts ({"type": "text", "text": ...})',
}


def _path(loc) -> tuple[str, str | None]:
    """('messages', 0, 'content', 'str') -> ("messages[0].content", union message or None)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
            continue
        out += f".{p}" if out else str(p)
        if p in _UNION_MESSAGES:
            return out, _UNION_MESSAGES[p]
    return out, None


def _param(loc) -> str | None:
    if not loc or not isinstance(loc[0], str):
        return None
    if loc[0] == "sampling_params" and len(loc) > 1 and isinstance(loc[1], str):
        return loc[1]
    return loc[0]


def api_error_from_validation(errors: list[dict]) -> ApiError:
    """pydantic errors -> one 400 naming the field (unknown fields are all listed)."""
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        names = ", ".join(f"'{_path(e['loc'])[0]}'" for e in extra)
        return ApiError(f"unknown field{'s' if len(extra) > 1 else ''} {names}: not part of this API (parameters "
                        "this server does not implement are refused, not ignored)", param=_param(extra[0]["loc"]))
    e = errors[0]
    path, union_msg = _path(e["loc"])
    if e["type"] == "missing":
        msg = f"'{path}' is required"
    elif union_msg:
        msg = f"'{path}' {union_msg}"
    else:
        msg = f"'{path}': {e['msg']}" if path else e["msg"]
    more = len({_path(x["loc"])[0] for x in errors}) - 1
    if more > 0:
        msg += f" (and {more} more invalid field{'s' if more > 1 else ''})"
    return ApiError(msg, param=_param(e["loc"]))
