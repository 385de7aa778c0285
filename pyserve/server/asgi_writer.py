"""`AsgiWriter`: streams written with the ASGI server's own `send`, under any ASGI server.

The chunks of one step (every stream's output of that step) are written by one task, one
`await send(...)` after another: a send that does not have to wait (the common case) costs a
coroutine call, not a task per stream. A send that does wait (its client reads slowly and
the server waits for the socket to drain) must not hold up the other streams: right after the
step's task first suspends, `_check` runs (scheduled right behind it, so nothing runs in
between), finds the stream the task waits on and leaves that task to finish that stream's
write and then its queued chunks (all its chunks not written yet queue behind it, joined into
one body message each time), and puts the rest of the step's items back ahead of those
queued since, for the next task.

A client that reads slowly or not at all must cost the others nothing: once a step's chunk
arrives while a write of its stream still waits (the client is a step behind), its request is
paused (`stream.pause`: no decode step takes it, so it makes no more output and no more work)
and resumes once all that waited is written. A send that merely suspends for a moment (a
server that queues every body) pauses nothing. What still comes
meanwhile (a step in flight) is capped at `max_buffer_bytes` queued (`--max-stream-buffer-bytes`);
past it the stream fails, as it does when one wait lasts `stall_timeout_s`
(`--stream-stall-timeout-s`): its request is aborted and its KV freed. A cumulative stream
(native /generate: each chunk carries everything so far) keeps only its latest chunk queued,
so a slow reader gets the newest state and holds one chunk. Loop thread only.
"""

from __future__ import annotations

import asyncio

from pyserve.server.stream_writer import (
    DEFAULT_MAX_BUFFER_BYTES,
    DEFAULT_STALL_TIMEOUT_S,
    StreamWriter,
    WrittenStream,
    overflow,
    stalled,
)

Item = tuple[WrittenStream, bytes, bool]


class _Queued:
    """A stream's chunks waiting behind its own write (`task`: the task writing it while its
    client is slow, else None; `timer`: the stall timeout of that wait; `paused`: its request
    was paused meanwhile), `size` their bytes."""

    __slots__ = ("chunks", "size", "final", "task", "timer", "paused")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.final = False
        self.task: asyncio.Task | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False


class _Run:
    """The writes one task makes in order: `items[at:]` are still to come; `current` is the
    stream whose send it awaits, `current_final` whether that is the stream's last chunk."""

    __slots__ = ("items", "at", "current", "current_final", "task", "handed_off")

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.at = 0
        self.current: WrittenStream | None = None
        self.current_final = False
        self.task: asyncio.Task | None = None
        self.handed_off = False  # the task now writes `current` only (a slow reader)


class AsgiWriter(StreamWriter):
    """Writes streams with `stream.send` (the ASGI send their response was called with)."""

    def __init__(
        self, max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    ) -> None:
        self._items: list[Item] = []
        self.max_buffer_bytes = max_buffer_bytes
        self.stall_timeout_s = stall_timeout_s
        self.overflowed = 0  # streams failed for a client that did not read (too much queued)
        self.stalled = 0  # streams failed for a client that did not read (for too long)

    def attach(self, stream: WrittenStream) -> bool:
        stream.writer_state = _Queued()
        stream.writer = self
        return True

    def write(self, stream: WrittenStream, data: bytes, final: bool) -> None:
        queued: _Queued = stream.writer_state
        if queued.task is not None:  # a slow reader: behind its write under way
            self._queue(stream, queued, data, final)
            return
        items = self._items
        items.append((stream, data, final))
        if len(items) == 1:  # the step's first: write once the step's outputs are all in
            asyncio.get_running_loop().call_soon(self._flush)

    def hold_back(self, stream: WrittenStream) -> bool:
        queued: _Queued = stream.writer_state
        if queued.task is None:
            return False
        self._behind(stream, queued)
        return True

    def _flush(self) -> None:
        items, self._items = self._items, []
        loop = asyncio.get_running_loop()
        run = _Run(items)
        run.task = loop.create_task(self._write(run))
        loop.call_soon(self._check, run)  # right behind the task's first step

    def _check(self, run: _Run) -> None:
        """The task of `run` suspended: it stays with the stream it waits on; the rest of its
        items go to a new task."""
        stream = run.current
        if run.task is None or run.task.done() or stream is None:
            return
        queued: _Queued = stream.writer_state
        queued.task = run.task
        run.handed_off = True
        queued.timer = asyncio.get_running_loop().call_later(self.stall_timeout_s, self._stall, stream, queued)
        # the stream's chunks not written yet (the rest of this run's, then those queued since)
        # wait behind its task from now on, in order; the others' go back ahead of those queued
        # since (all newer), for the next task
        rest = [item for item in run.items[run.at :] + self._items if not self._take(item, stream, queued)]
        run.items = []
        was_empty = not self._items
        self._items = rest
        if rest and was_empty:
            asyncio.get_running_loop().call_soon(self._flush)

    async def _write(self, run: _Run) -> None:
        while run.at < len(run.items):
            stream, data, final = run.items[run.at]
            run.at += 1
            queued: _Queued = stream.writer_state
            if queued.task is not None:  # it went slow earlier: behind its write
                self._queue(stream, queued, data, final)
                continue
            if data:
                run.current, run.current_final = stream, final
                try:
                    await stream.send({"type": "http.response.body", "body": data, "more_body": True})
                except Exception as exc:  # the connection broke: this stream ends, the others go on
                    run.current = None
                    if run.handed_off:
                        self._caught_up(queued)
                        stream.fail(exc)
                        return
                    stream.fail(exc)
                    continue
                run.current = None
                if run.handed_off:
                    await self._catch_up(stream, queued, final)
                    return
            if final:
                stream.written()

    async def _catch_up(self, stream: WrittenStream, queued: _Queued, final: bool) -> None:
        """Write a slow stream's queued chunks after its write under way (`final`: that was
        its last), then let its later chunks go with the steps' tasks again."""
        try:
            while not final:
                held = stream.take_held()
                if held:
                    self._queue(stream, queued, held, False)
                if not queued.chunks and not queued.final:
                    return
                chunks, final = queued.chunks, queued.final
                queued.chunks, queued.size = [], 0
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                if body:
                    await stream.send({"type": "http.response.body", "body": body, "more_body": True})
            stream.written()
        except Exception as exc:
            stream.fail(exc)
        finally:
            if queued.task is not None:  # (not failed meanwhile: `_stall`, an overflow)
                paused = queued.paused
                self._caught_up(queued)
                if paused:
                    stream.pause(False)

    @staticmethod
    def _caught_up(queued: _Queued) -> None:
        queued.task = None
        queued.paused = False
        if queued.timer is not None:
            queued.timer.cancel()
            queued.timer = None

    def _stall(self, stream: WrittenStream, queued: _Queued) -> None:
        """One wait of `stream` lasted `stall_timeout_s`: it fails."""
        task = queued.task
        if task is None:
            return
        self.stalled += 1
        queued.chunks, queued.size = [], 0
        self._caught_up(queued)
        stalled(stream, self.stall_timeout_s)
        task.cancel()

    def release(self, stream: WrittenStream) -> None:
        queued = stream.writer_state
        if isinstance(queued, _Queued) and queued.task is not None:
            task = queued.task
            self._caught_up(queued)
            task.cancel()  # its client is gone: a write waiting to drain never will

    def _take(self, item: Item, stream: WrittenStream, queued: _Queued) -> bool:
        """Queue `item` behind `stream`'s write if it is one of its chunks."""
        if item[0] is not stream:
            return False
        self._queue(stream, queued, item[1], item[2])
        return True

    @staticmethod
    def _behind(stream: WrittenStream, queued: _Queued) -> None:
        """A step's output came while `stream`'s write still waits: its request makes nothing
        more until it catches up."""
        if not queued.paused:
            queued.paused = True
            stream.pause(True)

    def _queue(self, stream: WrittenStream, queued: _Queued, data: bytes, final: bool) -> None:
        """Queue a chunk behind a slow reader's write: it replaces the queued ones of a
        cumulative stream; past `max_buffer_bytes` queued the stream fails."""
        if final:
            queued.final = True
        if not data:
            return
        if queued.task is not None:
            self._behind(stream, queued)
        if stream.coalesce:
            queued.chunks, queued.size = [data], len(data)
        else:
            queued.chunks.append(data)
            queued.size += len(data)
        if queued.size > self.max_buffer_bytes and queued.task is not None:
            # (a task writes it whenever chunks queue behind it: the check is for the types)
            self.overflowed += 1
            size, queued.chunks, queued.size = queued.size, [], 0
            task = queued.task
            self._caught_up(queued)
            overflow(stream, size, self.max_buffer_bytes)
            task.cancel()
