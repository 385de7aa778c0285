"""`AsgiWriter`: streams written with the ASGI server's own `send`, under any ASGI server.

Each stream with bytes to write has one task of its own that awaits `send` until the stream's
queue is empty, then ends; chunks that come while it writes queue behind it and go out
joined, in one body message. So a client that reads slowly (its server waits for the socket to
drain inside `send`) holds up its own task only, never the other streams. Where the event loop
can start a task eagerly (Python 3.12's `asyncio.eager_task_factory`), a write that does not
have to wait completes inside `write` and no task is ever scheduled; otherwise each stream
costs one task per step with output. Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from pyserve.server.stream_writer import StreamWriter, WrittenStream

logger = logging.getLogger(__name__)

_eager_task_factory: Callable[..., asyncio.Task] | None = getattr(asyncio, "eager_task_factory", None)


class _Queued:
    """A stream's bytes not yet handed to `send`, and the task writing them (None: idle)."""

    __slots__ = ("chunks", "final", "task")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.final = False
        self.task: asyncio.Task | None = None


class AsgiWriter(StreamWriter):
    """Writes streams with `stream.send` (the ASGI send their response was called with)."""

    def attach(self, stream: WrittenStream) -> bool:
        stream.writer_state = _Queued()
        stream.writer = self
        return True

    def write(self, stream: WrittenStream, data: bytes, final: bool) -> None:
        queued: _Queued = stream.writer_state
        if data:
            queued.chunks.append(data)
        if final:
            queued.final = True
        if queued.task is None:
            task = _start_task(self._drain(stream, queued))
            if not task.done():  # (an eager task that wrote everything is done already)
                queued.task = task

    @staticmethod
    async def _drain(stream: WrittenStream, queued: _Queued) -> None:
        try:
            while queued.chunks or queued.final:
                chunks, final = queued.chunks, queued.final
                queued.chunks = []
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                if body:
                    await stream.send({"type": "http.response.body", "body": body, "more_body": True})
                if final:
                    stream.written()
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the connection broke: this stream ends, the others go on
            stream.fail(exc)
        finally:
            queued.task = None

    def release(self, stream: WrittenStream) -> None:
        queued = stream.writer_state
        if isinstance(queued, _Queued) and queued.task is not None:
            queued.task.cancel()  # its client is gone: a write waiting to drain never will


def _start_task(coro: Coroutine[Any, Any, None]) -> asyncio.Task:
    loop = asyncio.get_running_loop()
    if _eager_task_factory is not None:
        return _eager_task_factory(loop, coro)
    return loop.create_task(coro)
