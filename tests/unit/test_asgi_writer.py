"""The ASGI writer of the stream hub: a slow reader holds up only its own stream (its chunks
queue behind its write, in order, and go out joined), a failed write ends that stream alone,
and a stream's first chunk and its end go through the hub's `attach`."""

from __future__ import annotations

import asyncio

from pyserve.forward_batch_info import FinishReason
from pyserve.io_struct import GenerateOutput
from pyserve.server.sse import DONE_EVENT
from pyserve.server.stream_hub import Stream, StreamHub


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


class Encoder:
    """Each output's text delta as the event's bytes; nothing after the last."""

    def __call__(self, out: GenerateOutput) -> bytes:
        return out.text_delta.encode()

    def end(self) -> bytes:
        return b""


def output(delta: str, last: bool = False) -> GenerateOutput:
    return GenerateOutput(
        rid="r",
        text="",
        text_delta=delta,
        output_ids=[],
        ids_delta=[],
        prompt_tokens=0,
        cached_tokens=0,
        finish_reason=FinishReason.length_limit(1) if last else None,
    )


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def started(hub: StreamHub) -> Stream:
    stream = Stream(Encoder(), receive=None, send=FakeSend())
    hub.attach(stream)
    return stream


def test_a_slow_reader_holds_up_only_its_own_stream():
    async def body():
        hub = StreamHub(socket_writes=False)
        slow, fast = started(hub), started(hub)
        slow.push(output("s1"))
        fast.push(output("f1"))
        await settle()
        slow.send.gate = asyncio.get_running_loop().create_future()  # the client stops reading
        for k in (2, 3):
            slow.push(output(f"s{k}"))
            fast.push(output(f"f{k}"))
            await settle()
        slow.push(output("s4", last=True))
        fast.push(output("f4", last=True))
        await settle()
        assert fast.send.bodies == [b"f1", b"f2", b"f3", b"f4" + DONE_EVENT] and fast.done.done()
        assert slow.send.bodies == [b"s1"] and not slow.done.done()
        slow.send.gate.set_result(None)  # it reads again
        slow.send.gate = None
        await settle()
        # s2 was mid-write; s3 and the end queued behind it and went out as one body
        assert slow.send.bodies == [b"s1", b"s2", b"s3s4" + DONE_EVENT] and slow.done.done()
        assert not slow.failed and slow.writer_state.task is None
        hub.close()

    asyncio.run(body())


def test_a_broken_connection_ends_its_stream_only():
    async def body():
        hub = StreamHub(socket_writes=False)
        gone, ok = started(hub), started(hub)
        gone.send.broken = True
        gone.push(output("g1"))
        ok.push(output("o1", last=True))
        await settle()
        assert gone.failed and gone.done.done() and gone.closed
        assert ok.send.bodies == [b"o1" + DONE_EVENT] and ok.done.done() and not ok.failed
        gone.push(output("g2"))  # later output of a closed stream is dropped
        await settle()
        assert gone.send.bodies == []
        hub.close()

    asyncio.run(body())


def test_outputs_before_the_start_go_out_first_and_whole():
    async def body():
        hub = StreamHub(socket_writes=False)
        stream = Stream(Encoder(), receive=None, send=FakeSend())
        stream.push(output("a"))
        stream.push(output("b", last=True))
        assert stream.first.result() is None and not stream.done.done()
        hub.attach(stream)
        await settle()
        assert stream.send.bodies == [b"ab" + DONE_EVENT] and stream.done.done()

    asyncio.run(body())


def test_a_server_whose_every_send_waits_gets_every_stream_in_order():
    """Each send suspends once (as a server that hands bodies to a queue may): every write
    goes to a task of its stream, yet each stream's bytes arrive whole and in order."""

    class YieldingSend(FakeSend):
        async def __call__(self, message: dict) -> None:
            await asyncio.sleep(0)
            self.bodies.append(message["body"])

    async def body():
        hub = StreamHub(socket_writes=False)
        streams = []
        for _ in range(4):
            stream = Stream(Encoder(), receive=None, send=YieldingSend())
            hub.attach(stream)
            streams.append(stream)
        for k in range(30):
            for i, stream in enumerate(streams):
                stream.push(output(f"<{i}.{k}>", last=k == 29))
            await asyncio.sleep(0)  # steps come faster than the writes
        for _ in range(200):
            await asyncio.sleep(0)
        for i, stream in enumerate(streams):
            assert b"".join(stream.send.bodies) == b"".join(b"<%d.%d>" % (i, k) for k in range(30)) + DONE_EVENT
            assert stream.done.done() and not stream.failed and stream.writer_state.task is None

    asyncio.run(body())


def test_a_slow_reader_pauses_its_request_until_it_catches_up():
    async def body():
        hub = StreamHub(socket_writes=False)
        slow, fast = started(hub), started(hub)
        pauses: dict[str, list[bool]] = {"slow": [], "fast": []}
        slow.on_pause, fast.on_pause = pauses["slow"].append, pauses["fast"].append
        slow.send.gate = asyncio.get_running_loop().create_future()  # the client stops reading
        slow.push(output("s1"))
        fast.push(output("f1"))
        await settle()
        assert pauses == {"slow": [], "fast": []}  # a write that waits: not behind yet
        slow.push(output("s2"))  # the next step's chunk comes while it waits: a step behind
        fast.push(output("f2"))
        await settle()
        assert pauses == {"slow": [True], "fast": []}
        slow.push(output("s3"))  # (a step in flight)
        await settle()
        slow.send.gate.set_result(None)  # it reads again
        slow.send.gate = None
        await settle()
        assert pauses == {"slow": [True, False], "fast": []} and slow.send.bodies == [b"s1", b"s2s3"]
        slow.push(output("s4", last=True))
        await settle()
        assert slow.done.done() and not slow.failed and pauses["slow"] == [True, False]
        hub.close()

    asyncio.run(body())


def test_a_slow_cumulative_stream_holds_its_newest_output_and_pauses():
    """A cumulative stream (each chunk holds all before it) keeps only its newest output back
    while its write waits, unencoded; that output coming is what pauses its request."""

    async def body():
        hub = StreamHub(socket_writes=False)
        stream = started(hub)
        stream.coalesce = True
        pauses: list[bool] = []
        stream.on_pause = pauses.append
        stream.send.gate = asyncio.get_running_loop().create_future()  # the client stops reading
        stream.push(output("a"))
        await settle()
        assert pauses == []
        stream.push(output("ab"))
        stream.push(output("abc"))
        await settle()
        assert pauses == [True] and stream.held is not None and stream.held.text_delta == "abc"
        stream.send.gate.set_result(None)
        stream.send.gate = None
        await settle()
        assert pauses == [True, False] and stream.send.bodies == [b"a", b"abc"] and stream.held is None
        stream.push(output("abcd", last=True))
        await settle()
        assert stream.send.bodies[-1] == b"abcd" + DONE_EVENT and stream.done.done() and pauses == [True, False]
        hub.close()

    asyncio.run(body())


def test_a_client_that_takes_nothing_for_the_stall_timeout_fails_its_stream(caplog):
    async def body():
        hub = StreamHub(socket_writes=False, stall_timeout_s=0.05)
        stuck, slow = started(hub), started(hub)
        pauses: list[bool] = []
        stuck.on_pause = pauses.append
        stuck.send.gate = asyncio.get_running_loop().create_future()  # never read
        slow.send.gate = asyncio.get_running_loop().create_future()  # read after 0.02 s
        stuck.push(output("x1"))
        slow.push(output("y1"))
        await settle()
        stuck.push(output("x2"))
        await asyncio.sleep(0.02)
        slow.send.gate.set_result(None)
        slow.send.gate = None
        await asyncio.sleep(0.08)
        assert stuck.failed and stuck.done.done() and stuck.writer_state.task is None and pauses == [True]
        assert not slow.failed and slow.send.bodies == [b"y1"]  # a wait shorter than the timeout
        assert hub.asgi_writer.stalled == 1
        stuck.pause(False)  # (a failed stream's request is aborted: no resume reaches it)
        assert pauses == [True]
        hub.close()

    asyncio.run(body())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "a streaming client took no output for 0.05 s (--stream-stall-timeout-s); its request is aborted"
    ]
