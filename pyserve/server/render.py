"""Turning response objects into bytes without ever failing on request-derived text.

Every JSON body, SSE event and error object of the server goes through `json_bytes`, which
cannot raise on a string: a lone surrogate (valid in JSON text as an escape, not encodable as
UTF-8) is written as its JSON escape `\\udcff` (the same character again when parsed), NUL and
control characters are escaped by the JSON encoder. `error_body` also truncates the texts it
quotes, so an error about a megabyte of input is not a megabyte itself.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.responses import JSONResponse

_ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY

# Longest message / param an error object carries, in characters (the whole body stays
# under about 1.3 kB).
MAX_ERROR_TEXT_CHARS = 1000
MAX_ERROR_PARAM_CHARS = 200


def json_bytes(obj: Any) -> bytes:
    """`obj` as compact UTF-8 JSON, encoded by orjson (the hot path: every SSE chunk). Strings
    with lone surrogates (which orjson refuses) go through the standard library instead and
    are written with JSON escapes: a raw surrogate can only stand inside a JSON string, where
    its six-character backslash-u form is a valid escape that parses back to the same
    character. NaN and infinities become null (orjson's rule; logprobs are made finite before).
    Raises TypeError for non-JSON types."""
    try:
        return orjson.dumps(obj, option=_ORJSON_OPTIONS)
    except orjson.JSONEncodeError as exc:
        if not isinstance(exc.__cause__, UnicodeError) and "str is not valid UTF-8" not in str(exc):
            raise TypeError(str(exc)) from exc
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace")


def clip_text(text: str, limit: int = MAX_ERROR_TEXT_CHARS) -> str:
    """`text` cut to `limit` characters (saying how much was cut), safe to encode."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI-style error object {"error": {"message", "type", "param", "code"}}, its
    texts clipped and made encodable (they may quote the request)."""
    return {"error": {
        "message": clip_text(str(message)),
        "type": type_,
        "param": None if param is None else clip_text(str(param), MAX_ERROR_PARAM_CHARS),
        "code": clip_text(code) if isinstance(code, str) else code,
    }}


class SafeJSONResponse(JSONResponse):
    """A JSONResponse rendered by `json_bytes` (never fails on a string)."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json_bytes(obj) + b"\n\n"
