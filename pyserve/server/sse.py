"""Server-sent events: turning an async iterator of JSON-able objects into an SSE response that
ends with `data: [DONE]`, and aborting generation when the client goes away."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

T = TypeVar("T")


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[Any]) -> StreamingResponse:
    """Stream `events` as SSE. When the client disconnects the iterator is closed, which
    aborts the request behind it."""

    async def body() -> AsyncIterator[str]:
        try:
            async for obj in events:
                yield sse_event(obj)
            yield "data: [DONE]\n\n"
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first, in which case `work` is cancelled
    (aborting its requests) and CancelledError is raised."""
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
        raise asyncio.CancelledError("client disconnected")
    finally:
        watcher.cancel()
