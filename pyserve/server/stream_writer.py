"""The seam between the stream hub and what puts a stream's bytes on the wire.

A `StreamWriter` takes the SSE bytes of streamed responses whose 200 was sent and writes them
to their clients in order; how is its own business (`AsgiWriter`: the ASGI server's `send`,
any server; `SocketWriter`: a thread writing uvicorn's sockets). A writer knows a stream only
as a `WrittenStream`: its ASGI `send` and `receive`, a slot for the writer's own state, and
the two calls a writer makes back (`written`, `fail`). Writers never import the hub.
Loop thread only.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Protocol

from starlette.types import Receive, Send

logger = logging.getLogger(__name__)

DEFAULT_MAX_BUFFER_BYTES = 2**20  # ServerArgs.max_stream_buffer_bytes' default
DEFAULT_STALL_TIMEOUT_S = 60.0  # ServerArgs.stream_stall_timeout_s' default


class WrittenStream(Protocol):
    """A streamed response as a writer sees it.

    send, receive: the ASGI callables its response was called with (send as the route's
    response got it, through any middleware). writer: the writer writing it now (a writer that
    hands the stream to another sets this). writer_state: the writer's per-stream state.
    coalesce: each chunk holds everything before it (a native cumulative stream), so a
    writer may keep only the latest of those waiting."""

    send: Send
    receive: Receive
    writer: StreamWriter | None
    writer_state: Any
    coalesce: bool

    def written(self) -> None:
        """Its last chunk is on the wire (the response may end)."""

    def fail(self, exc: BaseException) -> None:
        """A write failed (the client is gone): the stream ends, its request is aborted."""

    def pause(self, paused: bool) -> None:
        """Its client stopped taking chunks (True: a write waits for the socket to drain) or
        took all that waited (False); the request producing them pauses meanwhile."""

    def take_held(self) -> bytes:
        """The bytes of the newest output a coalescing stream held back, unencoded, while its
        writer was `behind` (b"" for none)."""


class StreamWriter(ABC):
    """Writes the body chunks of started SSE responses. Each stream's chunks go out in the order
    `write` got them; a client that reads slowly holds up only its own stream."""

    @abstractmethod
    def attach(self, stream: WrittenStream) -> bool:
        """Take `stream` (its response start was sent): True when this writer will write it
        (then it sets `stream.writer_state`), False to leave it to another writer."""

    @abstractmethod
    def write(self, stream: WrittenStream, data: bytes, final: bool) -> None:
        """Queue `data` (may be empty) for an attached stream; `final`: nothing follows, call
        `stream.written()` once it is all on the wire. Never blocks, never raises for a broken
        connection (that is `stream.fail`)."""

    @abstractmethod
    def release(self, stream: WrittenStream) -> None:
        """The response of `stream` ended (written, failed, or its client left): let go of
        what is held for it."""

    def hold_back(self, stream: WrittenStream) -> bool:
        """A coalescing `stream` has a step's output: True if it is to hold that output back
        unencoded, because its chunks wait behind a write its client is slow to take (the
        writer takes the newest with `take_held` when it catches up, and may pause the
        request meanwhile: its client is a step behind)."""
        return False

    def close(self) -> None:  # noqa: B027 - most writers hold nothing to stop
        """The server is stopping (streams still attached must still be written)."""


def overflow(stream: WrittenStream, queued_bytes: int, max_buffer_bytes: int) -> None:
    """Fail `stream`, whose client stopped reading: `queued_bytes` wait for it, past the bound
    (`--max-stream-buffer-bytes`). One WARNING; its request is aborted and its KV freed."""
    logger.warning(
        "a streaming client stopped reading: %d bytes queued for it, over --max-stream-buffer-bytes (%d); "
        "its request is aborted",
        queued_bytes,
        max_buffer_bytes,
    )
    stream.fail(BufferError("the client does not read its stream"))


def stalled(stream: WrittenStream, stall_timeout_s: float) -> None:
    """Fail `stream`, whose client took nothing for `stall_timeout_s` (`--stream-stall-timeout-s`)
    while its request was paused. One WARNING; its request is aborted and its KV freed."""
    logger.warning(
        "a streaming client took no output for %g s (--stream-stall-timeout-s); its request is aborted",
        stall_timeout_s,
    )
    stream.fail(TimeoutError("the client does not read its stream"))
