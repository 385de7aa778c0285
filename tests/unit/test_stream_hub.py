"""The stream hub: each step's chunks of every stream written by one task, a slow reader
holding up only its own stream (its chunks queue, in order), a failed write ending that
stream alone."""

from __future__ import annotations

import asyncio

from pyserve.server.stream_hub import SSEStream, StreamHub


class FakeSend:
    """An ASGI send recording bodies; `gate` (a future) makes writes wait while it is set."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.gate: asyncio.Future | None = None
        self.broken = False

    async def __call__(self, message: dict) -> None:
        if self.broken:
            raise ConnectionResetError("gone")
        if self.gate is not None:
            await self.gate
        self.bodies.append(message["body"])


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_slow_reader_holds_up_only_its_own_stream():
    async def body():
        hub = StreamHub()
        slow, fast = SSEStream(hub, str), SSEStream(hub, str)
        slow.send, fast.send = FakeSend(), FakeSend()
        hub.write(slow, b"s1", False)
        hub.write(fast, b"f1", False)
        await settle()
        slow.send.gate = asyncio.get_running_loop().create_future()  # the client stops reading
        for k in (2, 3):
            hub.write(slow, b"s%d" % k, False)
            hub.write(fast, b"f%d" % k, False)
            await settle()
        hub.write(slow, b"s4", True)
        hub.write(fast, b"f4", True)
        await settle()
        assert fast.send.bodies == [b"f1", b"f2", b"f3", b"f4"] and fast.done.done()
        assert slow.send.bodies == [b"s1"] and not slow.done.done()
        slow.send.gate.set_result(None)  # it reads again
        slow.send.gate = None
        await settle()
        assert slow.send.bodies == [b"s1", b"s2", b"s3", b"s4"] and slow.done.done()
        assert not slow.failed and slow.slow is None
        hub.close()

    asyncio.run(body())


def test_a_broken_connection_ends_its_stream_only():
    async def body():
        hub = StreamHub()
        gone, ok = SSEStream(hub, str), SSEStream(hub, str)
        gone.send, ok.send = FakeSend(), FakeSend()
        gone.send.broken = True
        hub.write(gone, b"g1", False)
        hub.write(ok, b"o1", True)
        await settle()
        assert gone.failed and gone.done.done() and gone.closed
        assert ok.send.bodies == [b"o1"] and ok.done.done() and not ok.failed
        hub.write(gone, b"g2", False)  # later output of a closed stream is dropped
        hub.close()

    asyncio.run(body())
