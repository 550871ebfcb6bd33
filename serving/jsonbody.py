"""Reading and parsing request bodies within fixed bounds, before any model validation sees them.

    raw = await read_body(request, limit=4 << 20)   # 413 past the limit, read chunk by chunk
    body = parse_json_body(raw)                      # 400 on anything absurd

Refused with a 400: invalid UTF-8 or JSON, a top level other than an object, NaN / Infinity,
integers longer than MAX_INT_DIGITS digits (Python would spend quadratic time on them, and no
field needs them), nesting deeper than MAX_DEPTH, and strings holding a lone UTF-16 surrogate
(``"\\ud800"`` is valid JSON but not valid Unicode: the tokenizer and the response encoder both
fail on it).
"""

from __future__ import annotations

import json
import re

import numpy as np
from starlette.requests import ClientDisconnect, Request

from serving.errors import ApiError

MAX_DEPTH = 64
MAX_INT_DIGITS = 40

_LONG_DIGITS = re.compile(rf"[0-9]{{{MAX_INT_DIGITS + 1}}}")
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # linear on valid JSON
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 as soon as it is known to pass `limit` bytes
    (from Content-Length before reading anything, else while reading a chunked body)."""
    too_big = ApiError(f"request body is larger than the server's limit of {limit} bytes", status=413,
                       code="request_too_large")
    cl = request.headers.get("content-length")
    if cl is not None and cl.strip().isdigit() and int(cl) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError("the client disconnected while sending the request body") from None
    return b"".join(chunks)


class _BadNumber(ValueError):
    pass


def _bounded_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise _BadNumber(f"an integer has {len(s.lstrip('-'))} digits; at most {MAX_INT_DIGITS} are accepted")
    return int(s)


def _no_constant(s: str):
    raise _BadNumber(f"{s} is not a valid JSON number")


def _max_depth(text: str) -> int:
    """Deepest array/object nesting of valid JSON text (strings are cut out first)."""
    syntax = _JSON_STRING.sub('""', text).encode("ascii", "ignore")
    a = np.frombuffer(syntax, np.uint8)
    step = ((a == 91) | (a == 123)).astype(np.int32) - ((a == 93) | (a == 125))
    return int(np.cumsum(step).max()) if len(step) else 0


def _lone_surrogate(obj, path: str = ""):
    """(path, index, code point) of the first string (or key) holding a lone surrogate, or None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            return path or "body", e.start, ord(obj[e.start])
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else str(k)
            found = _lone_surrogate(k, sub) or _lone_surrogate(v, sub)
            if found:
                return found
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found = _lone_surrogate(v, f"{path}[{i}]")
            if found:
                return found
    return None


def parse_json_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(f"request body is not valid UTF-8 ({e})") from None
    hooks = {"parse_constant": _no_constant}
    if _LONG_DIGITS.search(text):  # only then pay a Python call per integer
        hooks["parse_int"] = _bounded_int
    try:
        body = json.loads(text, **hooks)
    except json.JSONDecodeError as e:
        raise ApiError(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(f"request body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # _BadNumber, or Python's own limit on integer digits
        raise ApiError(f"request body holds an unacceptable number: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    if text.count("[") + text.count("{") > MAX_DEPTH and _max_depth(text) > MAX_DEPTH:
        raise ApiError(f"request body is nested too deeply (at most {MAX_DEPTH} levels)")
    if _SURROGATE_ESCAPE.search(text):
        found = _lone_surrogate(body)
        if found:
            path, i, cp = found
            path = path.encode("utf-8", "backslashreplace").decode("utf-8")  # a key may hold the surrogate itself
            raise ApiError(f"'{path}' holds a lone UTF-16 surrogate (\\u{cp:04x} at character {i}): strings must be "
                           "valid Unicode", param=path.split(".")[0].split("[")[0])
    return body
