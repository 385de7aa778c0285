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
    """`obj` as compact UTF-8 JSON, encoded by orjson (the hot path: every SSE chunk). What
    orjson refuses but a request may hold goes through the standard library instead: strings
    with lone surrogates, written with JSON escapes (a raw surrogate can only stand inside a
    JSON string, where its six-character backslash-u form is a valid escape that parses back
    to the same character), and integers beyond 64 bits (valid JSON; /v1/responses echoes
    the request's `metadata`). NaN and infinities become null (orjson's rule; logprobs are
    made finite before). Raises TypeError for non-JSON types."""
    try:
        return orjson.dumps(obj, option=_ORJSON_OPTIONS)
    except orjson.JSONEncodeError as exc:
        message = str(exc)
        if not (
            isinstance(exc.__cause__, UnicodeError)
            or "str is not valid UTF-8" in message
            or "Integer exceeds 64-bit range" in message
        ):
            raise TypeError(message) from exc
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace")


def clip_text(text: str, limit: int = MAX_ERROR_TEXT_CHARS) -> str:
    """`text` cut to `limit` characters (saying how much was cut), safe to encode."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """The OpenAI-style error object {"error": {"message", "type", "param", "code"}}, its
    texts clipped and made encodable (they may quote the request)."""
    return {
        "error": {
            "message": clip_text(str(message)),
            "type": type_,
            "param": None if param is None else clip_text(str(param), MAX_ERROR_PARAM_CHARS),
            "code": clip_text(code) if isinstance(code, str) else code,
        }
    }


class SafeJSONResponse(JSONResponse):
    """A JSONResponse rendered by `json_bytes` (never fails on a string)."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json_bytes(obj) + b"\n\n"


class NativeStreamEncoder:
    """The SSE events of one streamed native /generate request, in SGLang's cumulative shape
    (each chunk carries all text and output ids so far, as `GenerateOutput.to_native`), built
    in O(new tokens) per chunk: the JSON of the text and of the ids sent so far is kept and
    only extended (JSON string escapes are per character, so escaping the pieces and joining
    them equals escaping the whole). Each event's bytes equal `sse_event(out.to_native())`.
    Chunks with logprobs or a sample index are encoded whole. Call with each of the request's
    outputs in order; loop thread only."""

    __slots__ = ("_text", "_text_len", "_ids", "_num_ids", "_meta_head")
    cumulative = True  # each event supersedes the ones before (StreamHub may drop those unsent)

    def __init__(self) -> None:
        self._text = bytearray()  # the text so far as a JSON string body (no quotes)
        self._text_len = 0  # its length in characters
        self._ids = bytearray()  # the ids so far as JSON array items ("1,2,3")
        self._num_ids = 0
        # the meta_info of a running request up to its counts: `{"id":...,"finish_reason":null,`
        self._meta_head: tuple[str, bytes] | None = None

    def __call__(self, out: Any) -> bytes:
        if out.logprobs is not None or out.index is not None:
            return sse_event(out.to_native())
        text, delta = out.text, out.text_delta
        if len(text) != self._text_len + len(delta):  # not an extension (a stop string cut it)
            self._text = bytearray(json_bytes(text)[1:-1])
        elif delta:
            self._text += string_body(delta)
        self._text_len = len(text)
        num_ids, new = len(out.output_ids), out.ids_delta
        if num_ids != self._num_ids + len(new):
            self._ids = bytearray(json_bytes(list(out.output_ids))[1:-1])
        elif new:
            if self._num_ids:
                self._ids += b","
            self._ids += b"%d" % new[0] if len(new) == 1 else json_bytes(new)[1:-1]
        self._num_ids = num_ids
        if out.finish_reason is None:
            head = self._meta_head
            if head is None or head[0] != out.rid:
                head = self._meta_head = (out.rid, b'{"id":' + json_bytes(out.rid) + b',"finish_reason":null,')
            # what json_bytes(out.native_meta()) gives while running: integers in decimal
            meta = head[1] + b'"prompt_tokens":%d,"completion_tokens":%d,"cached_tokens":%d}' % (
                out.prompt_tokens,
                num_ids,
                out.cached_tokens,
            )
        else:
            meta = json_bytes(out.native_meta())
        return b"".join(
            (b'data: {"text":"', self._text, b'","output_ids":[', self._ids, b'],"meta_info":', meta, b"}\n\n")
        )

    def end(self) -> bytes:
        """Nothing follows the last output's event but `data: [DONE]`."""
        return b""


def string_body(text: str) -> bytes:
    """`text` as the inside of a JSON string (what `json_bytes(text)` puts between quotes)."""
    try:
        return orjson.dumps(text)[1:-1]
    except orjson.JSONEncodeError:  # a lone surrogate: json_bytes escapes it
        return json_bytes(text)[1:-1]
