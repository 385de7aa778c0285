"""The one streaming path: every SSE response (native /generate, OpenAI chat and completions,
n > 1, a failure after the 200) is a `StreamResponse` whose outputs become bytes in its
route's encoder and go to the wire through the `StreamHub`'s writers.

A streamed request's outputs arrive once per step (or per `stream_interval` tokens), for every
streaming request at once. Each output is turned into its SSE bytes where it is delivered
(`Stream.push`, the TokenizerManager's sink, called synchronously on the loop; or a task
pumping an output iterator, for n > 1) and handed to the stream's writer at once: no response
coroutine wakes per token. The hub gives each started stream a writer: the `SocketWriter`
thread where it can take it (uvicorn's HTTP/1.1), else the `AsgiWriter` (the ASGI `send` the
response was called with, under any ASGI server). The response coroutine only waits for its
stream's end or its client's disconnect (which aborts the request and frees its KV).

An encoder is a callable turning one output into the bytes of its SSE events (b"" for none);
its `end()` gives the events after the last output (e.g. OpenAI's usage chunk); `data: [DONE]`
follows. Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from starlette.types import Receive, Scope, Send

from pyserve.engine.end_cause import end_error
from pyserve.errors import InvalidRequestError, ModelStepError
from pyserve.io_struct import GenerateOutput
from pyserve.server.access_log import AccessRecord, access_record
from pyserve.server.asgi_writer import AsgiWriter
from pyserve.server.errors import error_response, exception_response
from pyserve.server.socket_writer import SocketWriter
from pyserve.server.sse import DONE_EVENT, SSE_HEADERS, error_event, wait_disconnect
from pyserve.server.stream_writer import DEFAULT_MAX_BUFFER_BYTES, DEFAULT_STALL_TIMEOUT_S, StreamWriter

logger = logging.getLogger(__name__)


class StreamEncoder(Protocol):
    """The SSE bytes of one route's stream (it may keep state: one encoder per response)."""

    def __call__(self, out: GenerateOutput) -> bytes: ...

    def end(self) -> bytes: ...


class Stream:
    """One streamed response (a `WrittenStream` to its writer).

    Outputs become SSE events (`encode`); the last is followed by `encode.end()` and
    `data: [DONE]`. A failure (the request's own parameters at 400, a failed model step at
    500, a pyserve bug) becomes an SSE error event and `data: [DONE]`, or, when nothing was
    sent yet, a plain error response (`first` holds it)."""

    __slots__ = (
        "encode",
        "send",
        "receive",
        "writer",
        "writer_state",
        "buffered",
        "ended",
        "first",
        "done",
        "closed",
        "failed",
        "coalesce",
        "held",
        "done_event",
        "on_pause",
        "record",
    )

    def __init__(self, encode: StreamEncoder, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        self.encode = encode
        self.send, self.receive = send, receive
        self.writer: StreamWriter | None = None  # set once the 200 was sent
        self.writer_state: Any = None
        self.buffered: list[bytes] = []  # events produced before the 200 was sent
        self.ended = False  # the last of them is among `buffered`
        self.first: asyncio.Future = loop.create_future()  # None, or the error before anything
        self.done: asyncio.Future = loop.create_future()  # the last event is on the wire
        self.closed = False  # nothing more is written (the last event was queued, or it failed)
        self.failed = False  # a write failed: the client is gone
        # a cumulative encoder's chunks each carry everything so far (WrittenStream.coalesce)
        self.coalesce: bool = getattr(encode, "cumulative", False)
        self.held: GenerateOutput | None = None  # (WrittenStream.take_held)
        # what ends the stream after the encoder's last events (the encoder may say: b"" for none)
        self.done_event: bytes = getattr(encode, "done_event", DONE_EVENT)
        self.on_pause: Callable[[bool], None] | None = None  # (StreamResponse's `pause`)
        self.record: AccessRecord | None = None  # its access-log line's counts (access_log.py)

    def push(self, out: GenerateOutput) -> None:
        """The output sink of a single request: the last output (finished) ends the stream."""
        if out.finish_reason is None and self.writer is not None and not self.closed:
            if self.coalesce and self.writer.hold_back(self):
                self.held = out  # its client is slow: only the newest is ever encoded
                return
            try:  # a running stream's chunk: `_add` without its checks
                data = self.encode(out)
            except Exception as exc:  # a pyserve bug: say so in the stream, keep the server sane
                self._emit(error_event(exc) + self.done_event, final=True)
                return
            if data:
                self.writer.write(self, data, False)
            return
        self._add(out, last=out.finish_reason is not None)

    def push_part(self, out: GenerateOutput) -> None:
        """One output of a stream that `end` ends (n > 1: one sample's, finished or not)."""
        self._add(out, last=False)

    def end(self) -> None:
        """The stream's outputs are all in (pushed by `push_part`)."""
        try:
            data = self.encode.end() + self.done_event
        except Exception as exc:
            data = error_event(exc) + self.done_event
        self._emit(data, final=True)

    def fail_request(self, exc: Exception) -> None:
        """The request failed: an error response if nothing was sent, else an error event."""
        if not self.first.done():
            self.closed = True
            self.first.set_result(exc)
            return
        self._emit(error_event(exc) + self.done_event, final=True)

    def _add(self, out: GenerateOutput, last: bool) -> None:
        self.held = None  # (this output comes after it: a cumulative one holds it)
        failure = end_error(out.finish_reason, streamed=True)
        if failure is not None:
            self.fail_request(failure)
            return
        if out.finish_reason is not None and self.record is not None:
            self.record.add_output(out)  # (once per finished output, never per step)
        try:
            data = self.encode(out)
            if last:
                data += self.encode.end() + self.done_event
        except Exception as exc:
            data, last = error_event(exc) + self.done_event, True
        self._emit(data, last)

    def _emit(self, data: bytes, final: bool) -> None:
        if not self.first.done():
            self.first.set_result(None)
        if self.closed:
            return
        if final:
            self.closed = True
        if self.writer is None:
            if data:
                self.buffered.append(data)
            self.ended = self.ended or final
            return
        if data or final:
            self.writer.write(self, data, final)

    # ---- what the writer calls (WrittenStream) --------------------------------------------------
    def written(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def fail(self, exc: BaseException) -> None:
        logger.debug("stream write failed: %s", exc)
        self.closed = self.failed = True
        self.written()

    def pause(self, paused: bool) -> None:
        if self.on_pause is not None and not self.closed:
            self.on_pause(paused)

    def take_held(self) -> bytes:
        out, self.held = self.held, None
        if out is None or self.closed:
            return b""
        return self.encode(out)  # (a pyserve bug raising here fails the stream: the writer's except)


class StreamHub:
    """The writers of every stream of an app: `SocketWriter` where it can take a stream
    (`socket_writes=False`: never), else `AsgiWriter`. max_buffer_bytes: what a stream whose
    client stops reading may have queued before it fails (`--max-stream-buffer-bytes`);
    stall_timeout_s: how long its request may stay paused before it fails
    (`--stream-stall-timeout-s`; see asgi_writer.py: a full socket hands its stream to the
    AsgiWriter)."""

    def __init__(
        self,
        socket_writes: bool = True,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        self.asgi_writer = AsgiWriter(max_buffer_bytes, stall_timeout_s)
        self.socket_writer = SocketWriter(self.asgi_writer, max_buffer_bytes) if socket_writes else None

    def attach(self, stream: Stream) -> None:
        """`stream`'s 200 was sent: give it a writer and write what it produced before."""
        if self.socket_writer is None or not self.socket_writer.attach(stream):
            self.asgi_writer.attach(stream)
        writer = stream.writer
        assert writer is not None
        data, stream.buffered = b"".join(stream.buffered), []
        if data or stream.ended:
            writer.write(stream, data, stream.ended)

    def release(self, stream: Stream) -> None:
        if stream.writer is not None:
            stream.writer.release(stream)

    def close(self) -> None:
        if self.socket_writer is not None:
            self.socket_writer.close()


class StreamResponse:
    """An ASGI response streaming one request through a StreamHub.

    start(stream) starts the request with its outputs going to `stream` (`Stream.push` as the
    sink, or a task calling `push_part`/`end`); abort() stops it and frees what it holds (the
    client left, or a write failed); pause(True / False), where given, pauses and resumes it
    while its client is behind (`WrittenStream.pause`). The 200 is sent once the first output
    came: a request failing at its first step gets a plain error response."""

    def __init__(
        self,
        hub: StreamHub,
        encode: StreamEncoder,
        start: Callable[[Stream], None],
        abort: Callable[[], None],
        pause: Callable[[bool], None] | None = None,
    ) -> None:
        self.hub, self.encode, self.start, self.abort, self.pause = hub, encode, start, abort, pause
        # the 200's headers: a route adding its own (x-pyserve-warning) replaces the shared list
        self.headers: list[tuple[bytes, bytes]] = SSE_HEADERS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = Stream(self.encode, receive, send)
        stream.on_pause = self.pause
        stream.record = access_record(scope)
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        finished = started = False
        try:
            self.start(stream)
            started = True  # (a start that raised holds nothing; its rid may be another's)
            await asyncio.wait({stream.first, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not stream.first.done():
                return  # the client left before anything came
            failure = stream.first.result()
            if failure is not None:
                finished = True
                await _failure_response(failure)(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            self.hub.attach(stream)
            if not stream.done.done():
                await asyncio.wait({stream.done, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finished = stream.done.done() and not stream.failed
            if finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.hub.release(stream)
            if started and not finished:
                stream.closed = True
                self.abort()


def outputs_response(hub: StreamHub, encode: StreamEncoder, outputs: AsyncIterator[GenerateOutput]) -> StreamResponse:
    """A StreamResponse of the outputs of an iterator (n > 1: its samples' outputs as they
    come); closing it (the client left) aborts what runs behind it."""
    task: asyncio.Task | None = None

    async def pump(stream: Stream) -> None:
        try:
            async for out in outputs:
                stream.push_part(out)
        except Exception as exc:
            stream.fail_request(exc)
            return
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        stream.end()

    def start(stream: Stream) -> None:
        nonlocal task
        stream.coalesce = False  # several samples' chunks interleave: none replaces another
        task = asyncio.ensure_future(pump(stream))

    def abort() -> None:
        if task is not None:
            task.cancel()

    return StreamResponse(hub, encode, start, abort)


def _failure_response(exc: Exception) -> Any:
    if isinstance(exc, (InvalidRequestError, ModelStepError)):
        return exception_response(exc)
    logger.error("stream failed", exc_info=exc)
    return error_response(500, f"internal server error: {type(exc).__name__}: {exc}", type_="internal_server_error")
