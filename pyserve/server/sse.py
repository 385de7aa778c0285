"""Server-sent events: turning an async iterator of JSON-able objects into an SSE response that
ends with `data: [DONE]`, and aborting generation when the client goes away."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from pyserve.errors import InvalidRequestError, ModelStepError
from pyserve.server.render import error_body, sse_event

logger = logging.getLogger(__name__)

T = TypeVar("T")


DONE_EVENT = b"data: [DONE]\n\n"


# The scope key under which `PyserveApp` keeps the ASGI server's own `send`.
RAW_SEND_KEY = "pyserve.raw_send"


class SSEResponse(StreamingResponse):
    """A StreamingResponse whose body chunks go to the ASGI server's `send` directly (kept in
    the scope by `PyserveApp`), not through the error middlewares' wrappers, which only
    watch for the response start (sent through them as usual). One SSE write per request
    per step is the hot path of streaming; the wrappers were a third of its cost."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self._raw_send = scope.get(RAW_SEND_KEY)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self._raw_send or send
        async for chunk in self.body_iterator:
            await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def error_event(exc: Exception) -> bytes:
    """The SSE event that ends a stream which failed after its 200 was sent: an OpenAI-style
    error object for the request's own fault (InvalidRequestError, its status as code), a
    failed model step (ModelStepError, logged by the worker: 500), or a pyserve bug (logged
    here: 500)."""
    if isinstance(exc, InvalidRequestError):
        return sse_event(error_body(exc.message, param=exc.param, code=exc.code or exc.status))
    if isinstance(exc, ModelStepError):
        return sse_event(error_body(str(exc), type_="internal_server_error", code=500))
    logger.error("stream failed", exc_info=exc)
    return sse_event(error_body(f"internal server error: {type(exc).__name__}: {exc}",
                                type_="internal_server_error", code=500))


def sse_response(events: AsyncIterator[Any], first: Any = None,
                 convert: Callable[[Any], Any] | None = None) -> StreamingResponse:
    """Stream `events` as SSE, ending with `data: [DONE]`; with `convert`, `first` (if not
    None) and then each item of `events` are sent as convert(item) (one generator layer
    fewer than wrapping `events`). When the client disconnects the iterator is closed,
    which aborts the request behind it. An error after the stream started (the 200 is sent)
    becomes an SSE event holding an OpenAI-style error object, then `data: [DONE]`: the
    client sees why the stream ended, never a cut connection."""

    async def body() -> AsyncIterator[bytes]:
        try:
            try:
                if convert is None:
                    async for obj in events:
                        yield sse_event(obj)
                elif first is not None:
                    yield sse_event(convert(first))
                    async for obj in events:
                        yield sse_event(convert(obj))
            except Exception as exc:
                yield error_event(exc)
            yield DONE_EVENT
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    return SSEResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first, in which case `work` is cancelled
    (aborting its requests) and starlette's ClientDisconnect is raised (answered quietly:
    nobody is listening)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnect()
    finally:
        watcher.cancel()
