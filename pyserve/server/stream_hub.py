"""Streamed responses written in one batch per step: the fast path of SSE streaming.

A streamed request's outputs arrive from the detokenizer once per step (or per
`stream_interval` tokens), for every streaming request at once. Instead of waking one
response coroutine per request per step (through an output queue, two async generators and
Starlette's StreamingResponse), each output is turned into its SSE bytes where it is delivered
(`SSEStream.push`, called synchronously by the TokenizerManager) and one `StreamHub` task
writes the step's chunks of every stream with the ASGI server's own `send`, or, for streams
on uvicorn's HTTP/1.1 protocol, hands them to the `StreamWriter` thread, which sends them with
the GIL released. Each response coroutine only waits for its stream's end or its client's
disconnect (which aborts the request and frees its KV). Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from pyserve.engine.tokenizer_manager import failure_of
from pyserve.io_struct import GenerateOutput
from pyserve.server.errors import exception_response
from pyserve.server.sse import DONE_EVENT, RAW_SEND_KEY, error_event
from pyserve.server.stream_writer import DirectState, StreamWriter

logger = logging.getLogger(__name__)

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class SSEStream:
    """One streamed response: outputs become SSE events (`encode(output)`, the event's bytes);
    the last one is followed by `data: [DONE]`. A failure the request's consumer would raise (its own
    parameters at 400, a failed model step at 500) becomes an SSE error event instead, or,
    when it is the very first output, a plain error response (nothing was sent yet)."""

    def __init__(self, hub: "StreamHub", encode: Callable[[GenerateOutput], bytes]) -> None:
        loop = asyncio.get_running_loop()
        self.hub = hub
        self.encode = encode
        self.send: Any = None  # the ASGI server's send, once the response started
        self.buffered: list[bytes] = []  # events pushed before the response started
        self.first: asyncio.Future = loop.create_future()  # the first event (or error)
        self.done: asyncio.Future = loop.create_future()  # the last event was written
        self.closed = False
        self.failed = False  # a write failed: the client is gone
        self.slow: asyncio.Future | None = None  # a write still under way (slow reader)
        self.backlog: list[tuple[bytes, bool]] = []  # chunks waiting behind it
        self.direct: DirectState | None = None  # set while the StreamWriter writes it

    def fail(self, exc: BaseException) -> None:
        logger.debug("stream write failed: %s", exc)
        self.closed = self.failed = True
        self._finish()

    def push(self, out: GenerateOutput) -> None:
        """The TokenizerManager's sink for this request: called on the loop with each output."""
        if out.finish_reason is None and self.send is not None and not self.closed:
            # a running stream's chunk (what `_event` and `_write` come to, without their checks)
            try:
                data = self.encode(out)
            except Exception as exc:  # a pyserve bug: say so in the stream, keep the server sane
                self._write(error_event(exc) + DONE_EVENT, final=True)
                return
            if self.direct is not None:
                self.hub.writer.write(self, data, False)  # type: ignore[union-attr]
            else:
                self.hub.write(self, data, False)
            return
        try:
            data = self._event(out)
        except Exception as exc:  # a pyserve bug: say so in the stream, keep the server sane
            self._write(error_event(exc) + DONE_EVENT, final=True)
            return
        self._write(data, final=out.finished)

    def _event(self, out: GenerateOutput) -> bytes:
        failure = failure_of(out) if out.finished else None
        if failure is not None:
            if not self.first.done():
                self.first.set_result(failure)
                return b""
            return error_event(failure) + DONE_EVENT
        data = self.encode(out)
        return data + DONE_EVENT if out.finished else data

    def _write(self, data: bytes, final: bool) -> None:
        if not self.first.done():
            self.first.set_result(None)
        if self.closed:
            return
        if self.send is None:
            if data:
                self.buffered.append(data)
            if final:
                self.closed = True
                self._finish()
            return
        self.hub.write(self, data, final)

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class StreamHub:
    """Writes the chunks of every stream of a step in one task, in the order they came.

    A write that cannot finish at once (the client reads slowly: the ASGI server waits for its
    socket to drain) must not hold up the other streams: that stream's write goes on in a
    task of its own, and its later chunks queue behind it (`SSEStream.backlog`). Streams the
    `StreamWriter` took (`attach`) are handed to its thread instead, once per step
    (`direct_writes=False`: never)."""

    def __init__(self, direct_writes: bool = True) -> None:
        self._items: list[tuple[SSEStream, bytes, bool]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.writer = StreamWriter(self) if direct_writes else None

    def attach(self, stream: SSEStream, send: Any) -> None:
        """`stream`'s response started: write it with `send` (the ASGI server's), or through
        the StreamWriter when it can take it."""
        stream.send = send
        if self.writer is not None:
            self.writer.attach(stream, send)

    def release(self, stream: SSEStream) -> None:
        """`stream`'s response ended: let go of what the StreamWriter holds for it."""
        if self.writer is not None:
            self.writer.release(stream)

    def write(self, stream: SSEStream, data: bytes, final: bool) -> None:
        items = self._items
        items.append((stream, data, final))
        if final:
            stream.closed = True
        if len(items) == 1:  # the first since the task took the last ones: wake it
            self._wake_task()

    def write_first(self, stream: SSEStream, chunks: list[tuple[bytes, bool]]) -> None:
        """Queue `stream`'s (data, final) chunks ahead of everything the hub holds (chunks
        produced before those: the StreamWriter hands back a stream that left it)."""
        if chunks:
            self._items[:0] = [(stream, data, final) for data, final in chunks]
            self._wake_task()

    def _wake_task(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            items, self._items = self._items, []  # (with the clear above: nothing awaited between)
            direct_write = self.writer.write if self.writer is not None else None
            for stream, data, final in items:
                if stream.direct is not None:
                    direct_write(stream, data, final)  # type: ignore[misc]
                    continue
                if stream.slow is not None:  # a write of this stream is still under way
                    stream.backlog.append((data, final))
                    continue
                message = {"type": "http.response.body", "body": data, "more_body": True}
                try:
                    waiting = _start(stream.send(message)) if data else None
                except Exception as exc:  # the connection broke: that stream ends, the others go on
                    stream.fail(exc)
                    continue
                if waiting is not None:
                    stream.slow = asyncio.ensure_future(self._finish_slow(stream, waiting, final))
                elif final:
                    stream._finish()

    @staticmethod
    async def _finish_slow(stream: SSEStream, waiting: tuple[Any, Any], final: bool) -> None:
        """Complete a stream's suspended write, then its queued chunks, in order."""
        try:
            await _resume(*waiting)
            while not final:
                if not stream.backlog:  # caught up: later chunks are written directly again
                    stream.slow = None
                    return
                data, final = stream.backlog.pop(0)
                if data:
                    await stream.send({"type": "http.response.body", "body": data, "more_body": True})
            stream._finish()
        except Exception as exc:
            stream.fail(exc)
        finally:
            if final or stream.failed:
                stream.slow = None

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.writer is not None:
            self.writer.close()


def _start(coro: Any) -> tuple[Any, Any] | None:
    """Run the coroutine `coro` up to its first suspension: None if it finished at once (a
    socket write that did not have to wait), else (coro, what it waits on) for `_resume`."""
    try:
        waited = coro.send(None)
    except StopIteration:
        return None
    return coro, waited


async def _resume(coro: Any, waited: Any) -> None:
    """Drive a coroutine started by `_start` to its end, as a task would."""
    while True:
        try:
            if waited is None:
                await asyncio.sleep(0)
            else:
                # what a Task does with a future its coroutine yielded: clear the flag the
                # yield set, then wait for it
                waited._asyncio_future_blocking = False
                await waited
        except BaseException as exc:  # what it waited on failed: let the coroutine see it
            try:
                waited = coro.throw(exc)
            except StopIteration:
                return
            continue
        try:
            waited = coro.send(None)
        except StopIteration:
            return


class HubSSEResponse:
    """An ASGI response streaming one request through a StreamHub.

    encode(output) gives an output's SSE event bytes (one encoder per request: it may keep
    state, as `NativeStreamEncoder` does). start(sink) starts the request with `sink` receiving
    its outputs; abort() stops it and frees what it holds (client gone, server shutting down).
    The 200 is sent once the first output came: a request failing at its first step gets a
    plain error response."""

    def __init__(self, hub: StreamHub, encode: Callable[[GenerateOutput], bytes],
                 start: Callable[[Callable[[GenerateOutput], None]], None], abort: Callable[[], None]) -> None:
        self.hub, self.encode, self.start, self.abort = hub, encode, start, abort

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        stream = SSEStream(self.hub, self.encode)
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        finished = False
        try:
            self.start(stream.push)
            await asyncio.wait({stream.first, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not stream.first.done():
                return  # the client left before anything came
            failure = stream.first.result()
            if failure is not None:
                finished = True
                await exception_response(failure)(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            raw = scope.get(RAW_SEND_KEY) or send
            for data in stream.buffered:
                await raw({"type": "http.response.body", "body": data, "more_body": True})
            stream.buffered = []
            self.hub.attach(stream, raw)
            if stream.done.done():  # everything came before the start
                finished = True
            else:
                await asyncio.wait({stream.done, watcher}, return_when=asyncio.FIRST_COMPLETED)
                finished = stream.done.done() and not stream.failed
            if finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.hub.release(stream)
            if not finished:
                stream.closed = True
                self.abort()


async def _wait_disconnect(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
