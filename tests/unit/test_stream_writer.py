"""The StreamWriter on a real uvicorn server (httptools, uvloop) and real sockets: streams it
writes are byte for byte what the ASGI path writes; a reader too slow for the socket buffer
still gets every byte in order (the stream goes back to the ASGI send); a client that leaves
mid-stream aborts its request; every duplicated fd is closed."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from pyserve.forward_batch_info import FinishReason
from pyserve.io_struct import GenerateOutput
from pyserve.server.http1 import HTTP1Protocol
from pyserve.server.sse import DONE_EVENT
from pyserve.server.stream_hub import HubSSEResponse, StreamHub


def event(k: int, size: int) -> bytes:
    return b"data: %d:" % k + bytes([65 + k % 26]) * size + b"\n\n"


class StreamServer:
    """uvicorn serving GET /?n=N&size=S: a stream of N outputs of S bytes each through one
    StreamHub, produced as fast as the loop runs (the last one finished)."""

    def __init__(self, direct_writes: bool) -> None:
        self.aborted = threading.Event()
        self.hub: StreamHub | None = None
        self.direct_writes = direct_writes
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, loop="uvloop",
                                http=HTTP1Protocol, log_level="warning", lifespan="off", interface="asgi3")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}/"

    async def app(self, scope, receive, send) -> None:
        if self.hub is None:
            self.hub = StreamHub(direct_writes=self.direct_writes)
        query = dict(p.split("=") for p in scope["query_string"].decode().split("&"))
        n, size = int(query["n"]), int(query["size"])
        count = iter(range(n))

        def encode(out: GenerateOutput) -> bytes:
            return event(next(count), size)

        def start(sink) -> None:
            async def produce() -> None:
                for k in range(n):
                    sink(GenerateOutput(rid="r", text="", text_delta="", output_ids=[], ids_delta=[],
                                        prompt_tokens=0, cached_tokens=0,
                                        finish_reason=FinishReason.length_limit(n) if k == n - 1 else None))
                    await asyncio.sleep(0)
            asyncio.ensure_future(produce())

        await HubSSEResponse(self.hub, encode, start, self.aborted.set)(scope, receive, send)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def expected(n: int, size: int) -> bytes:
    return b"".join(event(k, size) for k in range(n)) + DONE_EVENT


def fds_closed(server) -> bool:
    """Every socket fd the StreamWriter duplicated is closed again."""
    writer = server.hub.writer
    return writer is None or writer.open_fds == 0


def wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.fixture(params=[True, False], ids=["direct", "asgi"])
def server(request):
    srv = StreamServer(direct_writes=request.param)
    yield srv
    srv.stop()


def test_streams_are_written_byte_for_byte_and_every_fd_is_closed(server):
    with httpx.Client() as client:
        for n, size in ((1, 10), (300, 100), (50, 3000)):
            r = client.get(server.url + f"?n={n}&size={size}")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert r.content == expected(n, size)
        wait_for(lambda: fds_closed(server))
    writer = server.hub.writer
    if server.direct_writes:
        assert writer.chunks_sent > 0 and writer.diverted == 0
    else:
        assert writer is None
    assert not server.aborted.is_set()


def test_a_reader_slower_than_the_socket_gets_every_byte_in_order(server):
    n, size = 400, 64 * 1024  # 26 MB: far more than the socket buffers hold
    with httpx.Client(timeout=60) as client, client.stream("GET", server.url + f"?n={n}&size={size}") as r:
        time.sleep(0.5)  # not reading: the server's socket fills up
        body = r.read()
    assert body == expected(n, size)
    if server.direct_writes:
        assert server.hub.writer.diverted == 1
    wait_for(lambda: fds_closed(server))
    assert not server.aborted.is_set()


def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /?n=100000&size=1000 HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while len(got) < 100_000:
            got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200")
    assert server.aborted.wait(10)
    wait_for(lambda: fds_closed(server))
    if server.direct_writes:
        assert server.hub.writer.chunks_sent > 0  # it was written directly until the client left
