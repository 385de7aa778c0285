"""Server-sent events' fixed parts (the response headers, `data: [DONE]`, the error event that
ends a failed stream) and aborting a request's work when its client goes away. Streamed
responses themselves are pyserve.server.stream_hub's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive

from pyserve.errors import InvalidRequestError, ModelStepError
from pyserve.server.access_log import note_outputs
from pyserve.server.errors import http_of
from pyserve.server.render import error_body, sse_event

logger = logging.getLogger(__name__)

T = TypeVar("T")


DONE_EVENT = b"data: [DONE]\n\n"


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def error_event(exc: Exception) -> bytes:
    """The SSE event that ends a stream which failed after its 200 was sent: an OpenAI-style
    error object for the request's own fault (InvalidRequestError, its status as code), a
    failed model step (ModelStepError, logged by the worker: 500), or a pyserve bug (logged
    here: 500)."""
    if isinstance(exc, InvalidRequestError):
        status, code = http_of(exc)
        return sse_event(error_body(exc.message, param=exc.param, code=code or status))
    if isinstance(exc, ModelStepError):
        return sse_event(error_body(str(exc), type_="internal_server_error", code=500))
    logger.error("stream failed", exc_info=exc)
    return sse_event(
        error_body(f"internal server error: {type(exc).__name__}: {exc}", type_="internal_server_error", code=500)
    )


async def wait_disconnect(receive: Receive) -> None:
    """Return once the ASGI `receive` says the client disconnected (the request's body, if
    any, was read before: later messages are only the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first, in which case `work` is cancelled
    (aborting its requests) and starlette's ClientDisconnect is raised (answered quietly:
    nobody is listening). A list of final outputs it gives is counted in the request's
    access-log line (access_log.note_outputs)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            result = task.result()
            if isinstance(result, list):
                note_outputs(request.scope, result)
            return result
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnect()
    finally:
        watcher.cancel()
