"""`SocketWriter`: each step's SSE chunks sent to uvicorn's sockets from a thread of its own.

On loopback (and on any busy server) a socket send is a system call that also does the
kernel's delivery work: about 3 µs of the loop thread's CPU for every streamed token, with the
GIL held (uvloop sends with it), about a fifth of the loop's whole cost per token. This writer
moves those sends off the loop: the chunks of a step are handed to its thread, which sends
them all in one native call with the GIL released (`pyserve._rs.send_each`), then reports
back to the loop.

It takes a stream only when its response runs on uvicorn's httptools HTTP/1.1 protocol, plain
HTTP, with a chunked body, nothing queued on the connection, and a `send` that reaches
uvicorn's through Starlette's own middleware only (which passes body messages on unchanged);
its chunks are then framed here exactly as uvicorn frames them. What it reads of uvicorn
(`RequestResponseCycle`: `transport`, `flow.write_paused`, `chunked_encoding`,
`disconnected`, `response_complete`, `scope`; the chunk framing) is pinned by pyproject's
uvicorn range and by tests/unit/test_socket_writer_uvicorn.py. Anything else goes to the
fallback writer (the ASGI send). The thread sends to a duplicate of the connection's fd, so a
connection closed meanwhile can never be confused with a new one on the same fd number. A
stream has at most one chunk with the thread at a time; what it produces meanwhile is joined
into its next chunk. When a socket's buffer is full (a slow reader), the rest of that chunk
goes to the event loop's transport, which waits for the socket to drain, and the stream goes
to the fallback writer for good. Failed sends end that stream only.

The loop thread calls everything here except the thread's own `_run`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import queue
import threading
from typing import Any

from starlette.types import Receive, Send

from pyserve._rs import send_each
from pyserve.server.stream_writer import DEFAULT_MAX_BUFFER_BYTES, StreamWriter, WrittenStream, overflow

logger = logging.getLogger(__name__)

THREAD_NAME = "pyserve-stream-writer"

# uvicorn's HTTP/1.1 protocol whose request cycles this writer can write past
UVICORN_CYCLE_MODULE = "uvicorn.protocols.http.httptools_impl"
# The wrappers of `send` between an app and its route's response: each only watches the
# messages and passes every one on as it is (errors.ServerErrorMiddleware's `_send`,
# _exception_handler.wrap_app_handling_exceptions's `sender`, pyserve's access log's
# `access_send`); they hold the `send` they wrap in a closure variable named `send`
PASS_THROUGH_SEND_MODULES = frozenset(
    {"starlette.middleware.errors", "starlette._exception_handler", "pyserve.server.access_log"}
)


def uvicorn_cycle(receive: Receive, send: Send) -> Any:
    """uvicorn's httptools `RequestResponseCycle` behind an ASGI call's `receive` and `send`,
    when `send` reaches the cycle's own `send` through pass-through wrappers only (nothing
    between may change the body); else None."""
    cycle = getattr(receive, "__self__", None)
    if type(cycle).__module__ != UVICORN_CYCLE_MODULE:
        return None
    fn: Any = send  # walked through its closures, which the Send type does not describe
    for _ in range(8):  # (a few wrappers at most; a loop of closures must not hang us)
        if getattr(fn, "__self__", None) is cycle:
            return cycle if getattr(fn, "__name__", None) == "send" else None
        if getattr(fn, "__module__", None) not in PASS_THROUGH_SEND_MODULES:
            return None
        try:
            fn = fn.__closure__[fn.__code__.co_freevars.index("send")].cell_contents
        except (AttributeError, ValueError, TypeError, IndexError):
            return None
    return None


class DirectState:
    """A stream this writer writes: its duplicated socket fd, the transport that takes over when
    the socket is full, and its chunk with the thread (`busy`, `busy_final`) and the data
    produced meanwhile (`pending`, `pending_size` bytes, `pending_final`). `abandoned`: the
    response ended while a chunk was with the thread (the fd is closed when it comes back)."""

    __slots__ = ("fd", "transport", "busy", "busy_final", "pending", "pending_size", "pending_final", "abandoned")

    def __init__(self, fd: int, transport: Any) -> None:
        self.fd = fd
        self.transport = transport
        self.busy = self.busy_final = False
        self.pending: list[bytes] = []
        self.pending_size = 0
        self.pending_final = False
        self.abandoned = False


def http_chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked HTTP/1.1 body (RFC 9112 section 7.1), as uvicorn writes it."""
    return b"%x\r\n%s\r\n" % (len(data), data)


Batch = list[tuple[WrittenStream, DirectState, bytes]]


class SocketWriter(StreamWriter):
    """The thread that sends the chunks of the streams it took, and their state on the loop.
    `fallback` writes the streams it refuses or gives up (a full socket)."""

    def __init__(self, fallback: StreamWriter, max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES) -> None:
        self.fallback = fallback
        self.max_buffer_bytes = max_buffer_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._jobs: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._batch: Batch = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self.chunks_sent = 0  # chunks the thread sent whole
        self.open_fds = 0  # duplicated socket fds not closed yet (one per attached stream)
        self.diverted = 0  # streams handed to the fallback writer (a full socket)
        self.overflowed = 0  # streams failed for a client that did not read (before the divert)

    def attach(self, stream: WrittenStream) -> bool:
        """Take `stream` if its response runs on uvicorn's httptools cycle, plain HTTP, with a
        chunked body and nothing queued on its connection (see `uvicorn_cycle`)."""
        cycle = uvicorn_cycle(stream.receive, stream.send)
        transport = getattr(cycle, "transport", None)
        flow = getattr(cycle, "flow", None)
        scope = getattr(cycle, "scope", None)
        if (
            self._closed
            or getattr(cycle, "chunked_encoding", None) is not True
            or transport is None
            or flow is None
            or getattr(flow, "write_paused", True) is not False
            or getattr(cycle, "disconnected", True) is not False
            or getattr(cycle, "response_complete", True) is not False
            or not isinstance(scope, dict)
            or scope.get("scheme") != "http"
        ):
            return False  # (https: the socket carries TLS records, never plain bytes)
        try:
            if (
                transport.is_closing()
                or transport.get_write_buffer_size()
                or transport.get_extra_info("sslcontext") is not None
            ):
                return False
            fd = os.dup(transport.get_extra_info("socket").fileno())
        except (AttributeError, OSError, RuntimeError):
            return False
        self._loop = asyncio.get_running_loop()
        stream.writer_state = DirectState(fd, transport)
        stream.writer = self
        self.open_fds += 1
        return True

    def write(self, stream: WrittenStream, data: bytes, final: bool) -> None:
        """Queue one output's bytes (sent at the next `flush`, or joined into the stream's next
        chunk while one is with the thread; past `max_buffer_bytes` waiting, a coalescing
        stream keeps its latest and any other fails, as the fallback's do)."""
        state: DirectState = stream.writer_state
        if not state.busy:
            self._queue(stream, state, data, final)
            return
        state.pending_final = state.pending_final or final
        if not data:
            return
        state.pending.append(data)
        state.pending_size += len(data)
        if state.pending_size <= self.max_buffer_bytes or len(state.pending) == 1:
            return  # (one output larger than the bound is not a reader falling behind)
        if stream.coalesce:  # each chunk holds all before it: the newest stands for them
            state.pending, state.pending_size = [data], len(data)
        else:
            self.overflowed += 1
            size, state.pending, state.pending_size = state.pending_size, [], 0
            overflow(stream, size, self.max_buffer_bytes)

    def _queue(self, stream: WrittenStream, state: DirectState, data: bytes, final: bool) -> None:
        if not data:
            if final:
                self._detach(state)
                stream.written()
            return
        state.busy, state.busy_final = True, final
        batch = self._batch
        batch.append((stream, state, http_chunk(data)))
        if len(batch) == 1:  # the step's first: flush once the step's outputs are all in
            self._loop.call_soon(self.flush)  # type: ignore[union-attr]

    def flush(self) -> None:
        """Hand the chunks queued since the last flush to the thread (scheduled with
        `call_soon` by the first chunk queued: once per step, after the step's outputs)."""
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        if self._closed:  # shutting down: the thread may be gone; send from here
            self._sent(batch, self._send(batch))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()
        self._jobs.put(batch)

    def release(self, stream: WrittenStream) -> None:
        """Close the stream's fd, now or when its chunk with the thread comes back."""
        state = stream.writer_state
        if not isinstance(state, DirectState) or state.fd < 0:
            return
        if state.busy:
            state.abandoned = True
        else:
            self._detach(state)

    def close(self) -> None:
        """Stop the thread once it has sent what it was given; chunks of streams still
        attached are sent from the loop from now on (at shutdown)."""
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)

    def _detach(self, state: DirectState) -> None:
        if state.fd < 0:
            return
        fd, state.fd = state.fd, -1
        self.open_fds -= 1
        try:
            os.close(fd)
        except OSError:  # pragma: no cover - the fd is ours; nothing else closes it
            logger.exception("closing a stream's socket fd")

    def _run(self) -> None:
        """The thread: send each batch, report the results to the loop."""
        while True:
            batch = self._jobs.get()
            if batch is None:
                return
            results = self._send(batch)
            loop = self._loop
            try:
                assert loop is not None
                loop.call_soon_threadsafe(self._sent, batch, results)
            except RuntimeError:  # the loop is closed: the server is gone
                return

    @staticmethod
    def _send(batch: Batch) -> list[int]:
        try:
            return send_each([state.fd for _, state, _ in batch], [chunk for _, _, chunk in batch])
        except BaseException:  # a pyserve bug (a Rust panic included): those streams fail, the rest go on
            logger.exception("sending a step's stream chunks")
            return [-errno.EIO] * len(batch)

    def _sent(self, batch: Batch, results: list[int]) -> None:
        """On the loop: each stream's chunk was sent (all, part, or failed)."""
        for (stream, state, chunk), sent in zip(batch, results):
            state.busy = False
            self.chunks_sent += sent == len(chunk)
            if state.abandoned:
                self._detach(state)
            elif sent < 0:
                self._detach(state)
                stream.fail(OSError(-sent, os.strerror(-sent)))
            elif sent < len(chunk):
                self._divert(stream, state, chunk[sent:])
            elif state.busy_final:
                self._detach(state)
                stream.written()
            elif state.pending or state.pending_final:
                data, final = b"".join(state.pending), state.pending_final
                state.pending, state.pending_size, state.pending_final = [], 0, False
                self._queue(stream, state, data, final)

    def _divert(self, stream: WrittenStream, state: DirectState, rest: bytes) -> None:
        """The socket is full: its transport takes the rest of the chunk (and waits for the
        socket to drain), and the stream's later chunks go to the fallback writer."""
        self._detach(state)
        self.diverted += 1
        try:
            state.transport.write(rest)
        except Exception as exc:  # the connection is closing
            stream.fail(exc)
            return
        if state.busy_final:
            stream.written()
            return
        fallback = self.fallback
        fallback.attach(stream)
        if state.pending or state.pending_final:
            fallback.write(stream, b"".join(state.pending), state.pending_final)
