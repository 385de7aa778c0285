"""A request's JSON body, read within the app's size limit and checked strictly (no NaN or
Infinity, every string valid Unicode), before any route model sees it."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from pyserve.errors import InvalidRequestError, RequestTooLargeError
from pyserve.server.context import context_of


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def parse_json(request: Request) -> Any:
    """The request body as strict JSON (no NaN / Infinity) whose strings are all valid
    Unicode; InvalidRequestError otherwise (param: the path of a string holding a lone
    surrogate, which no tokenizer can read and no UTF-8 response can carry).
    RequestTooLargeError (413) for a body over the app's `max_request_body_bytes`
    (`--max-request-body-bytes`): by its Content-Length before anything is read, else as
    soon as the bytes read pass it."""
    body = await read_body(request, context_of(request).max_request_body_bytes)
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise InvalidRequestError("the request body is nested too deeply") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc
    bad = _lone_surrogate_path(obj)
    if bad is not None:
        raise InvalidRequestError(
            f"{bad or 'a field name'}: the text is not valid Unicode (it holds a lone surrogate)", param=bad or None
        )
    return obj


async def read_body(request: Request, limit: int | None) -> bytes:
    """The request's body; RequestTooLargeError once it is known to exceed `limit` bytes
    (None: no limit)."""
    if limit is None:
        return await request.body()
    try:
        declared = int(request.headers.get("content-length", "0"))
    except ValueError:
        declared = 0  # (uvicorn refuses a malformed Content-Length before a route runs)
    if declared > limit:
        raise RequestTooLargeError(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLargeError(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _lone_surrogate_path(obj: Any) -> str | None:
    """The dotted path of the first string (value or key) that cannot be encoded as UTF-8
    ("" for a top-level key), else None. Iterative (the body may be nested deeply); numbers
    are skipped without building paths (token-id lists are long)."""

    def bad(text: str) -> bool:
        if text.isascii():
            return False
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False

    def join(path: str, key: object) -> str:
        return f"{path}.{key}" if path else str(key)

    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if bad(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if bad(key):
                    return path
                if isinstance(item, (str, dict, list)):
                    stack.append((item, join(path, key)))
        elif isinstance(value, list):
            stack.extend((item, join(path, i)) for i, item in enumerate(value) if isinstance(item, (str, dict, list)))
    return None
