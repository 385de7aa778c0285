"""Sending each step's SSE chunks to their sockets from a thread of their own.

On loopback (and on any busy server) a socket send is a system call that also does the
kernel's delivery work: about 3 µs of the loop thread's CPU for every streamed token, with the
GIL held (uvloop sends with it), about a fifth of the loop's whole cost per token. The
`StreamWriter` moves those sends off the loop: each step, the StreamHub hands it the chunks of
the streams it writes directly, and its thread sends them all in one native call with the GIL
released (`pyserve._rs.send_each`), then reports back to the loop.

A stream is written directly only while nothing else is queued on its connection: it joins
once its response started through the ASGI server (uvicorn's httptools protocol, chunked body)
with an empty write buffer, and its body chunks are then framed here exactly as uvicorn frames
them. The thread sends to a duplicate of the connection's fd, so a connection closed meanwhile
can never be confused with a new one on the same fd number. A stream has at most one chunk
with the thread at a time; what it produces meanwhile is joined into its next chunk. When a
socket's buffer is full (a slow reader), the rest of that chunk goes to the event loop's
transport, which waits for the socket to drain, and the stream goes back to the ASGI send for
good (the hub's slow-reader handling). Failed sends end that stream only.

The loop thread calls everything here except the thread's own `_run`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import queue
import threading
from typing import TYPE_CHECKING, Any

from pyserve._rs import send_each

if TYPE_CHECKING:
    from pyserve.server.stream_hub import SSEStream, StreamHub

logger = logging.getLogger(__name__)

THREAD_NAME = "pyserve-stream-writer"


class DirectState:
    """A directly written stream: its duplicated socket fd, the transport that takes over when
    the socket is full, and its chunk with the thread (`busy`, `busy_final`) and the data
    produced meanwhile (`pending`, `pending_final`). `abandoned`: the response ended while a
    chunk was with the thread (the fd is closed when it comes back)."""

    __slots__ = ("fd", "transport", "busy", "busy_final", "pending", "pending_final", "abandoned")

    def __init__(self, fd: int, transport: Any) -> None:
        self.fd = fd
        self.transport = transport
        self.busy = self.busy_final = False
        self.pending: list[bytes] = []
        self.pending_final = False
        self.abandoned = False


def http_chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked HTTP/1.1 body (RFC 9112 section 7.1), as uvicorn writes it."""
    return b"%x\r\n%s\r\n" % (len(data), data)


class StreamWriter:
    """The thread that sends directly written streams' chunks, and their state on the loop."""

    def __init__(self, hub: "StreamHub") -> None:
        self.hub = hub
        self._loop: asyncio.AbstractEventLoop | None = None
        self._jobs: queue.SimpleQueue[list[tuple[SSEStream, int, bytes]] | None] = queue.SimpleQueue()
        self._batch: list[tuple[SSEStream, int, bytes]] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self.chunks_sent = 0  # chunks the thread sent whole
        self.open_fds = 0  # duplicated socket fds not closed yet (one per attached stream)
        self.diverted = 0  # streams handed back to the ASGI path (a full socket)

    def attach(self, stream: "SSEStream", send: Any) -> bool:
        """Write `stream` directly from now on, if `send` (the ASGI server's send, after the
        response start) is uvicorn's httptools cycle with a chunked body and nothing queued on
        its connection; else leave it to the hub's ASGI path. True when attached."""
        cycle = getattr(send, "__self__", None)
        transport = getattr(cycle, "transport", None)
        flow = getattr(cycle, "flow", None)
        scope = getattr(cycle, "scope", None)
        if (self._closed or getattr(cycle, "chunked_encoding", None) is not True or transport is None
                or flow is None or getattr(flow, "write_paused", True) or getattr(cycle, "disconnected", True)
                or getattr(cycle, "response_complete", True)
                or not isinstance(scope, dict) or scope.get("scheme") != "http"):
            return False  # (https: the socket carries TLS records, never plain bytes)
        try:
            if (transport.is_closing() or transport.get_write_buffer_size()
                    or transport.get_extra_info("sslcontext") is not None):
                return False
            fd = os.dup(transport.get_extra_info("socket").fileno())
        except (AttributeError, OSError, RuntimeError):
            return False
        self._loop = asyncio.get_running_loop()
        stream.direct = DirectState(fd, transport)
        self.open_fds += 1
        return True

    def write(self, stream: "SSEStream", data: bytes, final: bool) -> None:
        """Queue one output's bytes of a directly written stream (sent at the next `flush`)."""
        state = stream.direct
        assert state is not None
        if state.busy:
            if data:
                state.pending.append(data)
            state.pending_final = state.pending_final or final
        else:
            self._queue(stream, state, data, final)

    def _queue(self, stream: "SSEStream", state: DirectState, data: bytes, final: bool) -> None:
        if not data:
            if final:
                self._detach(stream, state)
                stream._finish()
            return
        state.busy, state.busy_final = True, final
        batch = self._batch
        batch.append((stream, state.fd, http_chunk(data)))
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

    def release(self, stream: "SSEStream") -> None:
        """The response of `stream` ended (finished, failed or its client left): close its fd,
        now or when its chunk with the thread comes back."""
        state = stream.direct
        if state is None:
            return
        if state.busy:
            state.abandoned = True
        else:
            self._detach(stream, state)

    def close(self) -> None:
        """Stop the thread once it has sent what it was given; chunks of streams still
        attached are sent from the loop from now on (at shutdown)."""
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)

    def _detach(self, stream: "SSEStream", state: DirectState) -> None:
        stream.direct = None
        self.open_fds -= 1
        try:
            os.close(state.fd)
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
    def _send(batch: list[tuple["SSEStream", int, bytes]]) -> list[int]:
        try:
            return send_each([fd for _, fd, _ in batch], [chunk for _, _, chunk in batch])
        except BaseException:  # a pyserve bug (a Rust panic included): those streams fail, the rest go on
            logger.exception("sending a step's stream chunks")
            return [-errno.EIO] * len(batch)

    def _sent(self, batch: list[tuple["SSEStream", int, bytes]], results: list[int]) -> None:
        """On the loop: each stream's chunk was sent (all, part, or failed)."""
        for (stream, _, chunk), sent in zip(batch, results):
            state = stream.direct
            assert state is not None
            state.busy = False
            self.chunks_sent += sent == len(chunk)
            if state.abandoned:
                self._detach(stream, state)
            elif sent < 0:
                self._detach(stream, state)
                stream.fail(OSError(-sent, os.strerror(-sent)))
            elif sent < len(chunk):
                self._divert(stream, state, chunk[sent:])
            elif state.busy_final:
                self._detach(stream, state)
                stream._finish()
            elif state.pending or state.pending_final:
                data, final = b"".join(state.pending), state.pending_final
                state.pending, state.pending_final = [], False
                self._queue(stream, state, data, final)

    def _divert(self, stream: "SSEStream", state: DirectState, rest: bytes) -> None:
        """The socket is full: its transport takes the rest of the chunk (and waits for the
        socket to drain), and the stream's later outputs go through the hub's ASGI path."""
        self._detach(stream, state)
        self.diverted += 1
        try:
            state.transport.write(rest)
        except Exception as exc:  # the connection is closing
            stream.fail(exc)
            return
        if state.busy_final:
            stream._finish()
            return
        # ahead of the stream's outputs the hub holds already: those came later
        self.hub.write_first(stream, [(data, False) for data in state.pending]
                             + ([(b"", True)] if state.pending_final else []))
