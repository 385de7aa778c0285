"""The SocketWriter on a real uvicorn server (httptools, uvloop) and real sockets: streams it
writes are byte for byte what the ASGI path writes; a reader too slow for the socket buffer
still gets every byte in order (the stream goes back to the ASGI send); a client that leaves
mid-stream aborts its request; one that stops reading is cut at the stream buffer bound, or,
for a cumulative stream, keeps only its latest chunk queued; a TLS connection is never
written to directly; streams still going when the writer closes (shutdown) finish from the
loop; every duplicated fd is closed."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
import threading
import time

import httpx
import pytest
import uvicorn

from pyserve.forward_batch_info import FinishReason
from pyserve.io_struct import GenerateOutput
from pyserve.server.asgi_writer import AsgiWriter
from pyserve.server.http1 import HTTP1Protocol
from pyserve.server.socket_writer import UVICORN_CYCLE_MODULE, DirectState, SocketWriter
from pyserve.server.sse import DONE_EVENT
from pyserve.server.stream_hub import Stream, StreamHub, StreamResponse


def event(k: int, size: int) -> bytes:
    return b"data: %d:" % k + bytes([65 + k % 26]) * size + b"\n\n"


class StreamServer:
    """uvicorn serving GET /?n=N&size=S: a stream of N outputs of S bytes each through one
    StreamHub, produced as fast as the loop runs (the last one finished); &cumulative=1: its
    encoder says each chunk holds all before it. max_buffer_bytes: the hub's bound (large by
    default: these tests read everything, late)."""

    def __init__(self, direct_writes: bool, max_buffer_bytes: int = 2**30, **tls: str) -> None:
        self.max_buffer_bytes = max_buffer_bytes
        self.aborted = threading.Event()
        self.hub: StreamHub | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.direct_writes = direct_writes
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            loop="uvloop",
            http=HTTP1Protocol,
            log_level="warning",
            lifespan="off",
            interface="asgi3",
            **tls,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.01)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/"

    async def app(self, scope, receive, send) -> None:
        if self.hub is None:
            self.hub = StreamHub(socket_writes=self.direct_writes, max_buffer_bytes=self.max_buffer_bytes)
            self.loop = asyncio.get_running_loop()
        query = dict(p.split("=") for p in scope["query_string"].decode().split("&"))
        n, size, pause = int(query["n"]), int(query["size"]), float(query.get("pause", 0))

        class Encoder:
            cumulative = query.get("cumulative") == "1"

            def __call__(self, out: GenerateOutput) -> bytes:
                return event(int(out.text), size)  # (the output's number)

            def end(self) -> bytes:
                return b""

        def start(stream) -> None:
            async def produce() -> None:
                for k in range(n):
                    stream.push(
                        GenerateOutput(
                            rid="r",
                            text=str(k),
                            text_delta="",
                            output_ids=[],
                            ids_delta=[],
                            prompt_tokens=0,
                            cached_tokens=0,
                            finish_reason=FinishReason.length_limit(n) if k == n - 1 else None,
                        )
                    )
                    await asyncio.sleep(pause)

            asyncio.ensure_future(produce())

        await StreamResponse(self.hub, Encoder(), start, self.aborted.set)(scope, receive, send)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def expected(n: int, size: int) -> bytes:
    return b"".join(event(k, size) for k in range(n)) + DONE_EVENT


def fds_closed(server) -> bool:
    """Every socket fd the SocketWriter duplicated is closed again."""
    writer = server.hub.socket_writer
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
    writer = server.hub.socket_writer
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
        assert server.hub.socket_writer.diverted == 1
    wait_for(lambda: fds_closed(server))
    assert not server.aborted.is_set()


def overflowed(server) -> int:
    """Streams failed at the bound: by the socket writer while its chunk was with the thread, or
    by the ASGI writer once the stream was handed to it."""
    hub = server.hub
    return hub.asgi_writer.overflowed + (hub.socket_writer.overflowed if hub.socket_writer else 0)


@pytest.fixture(params=[True, False], ids=["direct", "asgi"])
def bounded_server(request):
    srv = StreamServer(direct_writes=request.param, max_buffer_bytes=2**20)
    yield srv
    srv.stop()


def test_a_client_that_stops_reading_is_cut_at_the_buffer_bound(bounded_server):
    n, size = 400, 64 * 1024  # 26 MB: the socket buffers fill, then the bound is passed
    with socket.create_connection(("127.0.0.1", bounded_server.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.sendall(f"GET /?n={n}&size={size} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert bounded_server.aborted.wait(10)  # never read: its request is aborted
    assert overflowed(bounded_server) == 1
    wait_for(lambda: fds_closed(bounded_server))


def test_a_cumulative_stream_keeps_only_its_latest_chunk(bounded_server):
    n, size = 400, 64 * 1024
    with httpx.Client(timeout=60) as client:
        with client.stream("GET", bounded_server.url + f"?n={n}&size={size}&cumulative=1") as r:
            time.sleep(1.0)  # not reading while all 400 are produced
            body = r.read()
    events = body.split(b"\n\n")[:-1]
    numbers = [int(e.split(b":")[1]) for e in events[:-1]]
    assert events[-1] + b"\n\n" == DONE_EVENT and numbers[-1] == n - 1
    assert numbers == sorted(numbers) and len(numbers) < n  # the ones queued behind were dropped
    for k, e in zip(numbers, events):
        assert e + b"\n\n" == event(k, size)
    assert not bounded_server.aborted.is_set() and overflowed(bounded_server) == 0
    wait_for(lambda: fds_closed(bounded_server))


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
        assert server.hub.socket_writer.chunks_sent > 0  # it was written directly until the client left


def test_a_tls_connection_is_never_written_directly(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    srv = StreamServer(direct_writes=True, ssl_keyfile=str(key), ssl_certfile=str(cert))
    try:
        with httpx.Client(verify=False, timeout=30) as client:
            for n, size in ((5, 10), (200, 1000)):
                assert client.get(srv.url + f"?n={n}&size={size}").content == expected(n, size)
        assert srv.hub.socket_writer.chunks_sent == 0 and srv.hub.socket_writer.open_fds == 0
    finally:
        srv.stop()


def test_attach_refuses_what_it_cannot_write_plainly():
    """Only uvicorn's httptools cycle on a plain-HTTP connection with nothing queued is taken."""

    class Flow:
        write_paused = False

    class Transport:
        def __init__(self, sock, ssl_context=None, buffered=0):
            self.sock, self.ssl_context, self.buffered = sock, ssl_context, buffered

        def is_closing(self):
            return False

        def get_write_buffer_size(self):
            return self.buffered

        def get_extra_info(self, name):
            return {"socket": self.sock, "sslcontext": self.ssl_context}[name]

    class Cycle:
        def __init__(self, transport, scheme="http", **attrs):
            self.transport, self.flow, self.scope = transport, Flow(), {"scheme": scheme}
            self.chunked_encoding, self.disconnected, self.response_complete = True, False, False
            self.__dict__.update(attrs)

        async def send(self, message):
            pass

        async def receive(self):
            return {"type": "http.disconnect"}

    Cycle.__module__ = UVICORN_CYCLE_MODULE  # stands for uvicorn's RequestResponseCycle

    def stream_of(cycle, send=None) -> Stream:
        return Stream(bytes, receive=cycle.receive, send=send or cycle.send)

    async def body():
        a, b = socket.socketpair()
        hub = StreamHub()
        writer = hub.socket_writer
        cases = {
            "https scheme": Cycle(Transport(a), scheme="https"),
            "TLS transport": Cycle(Transport(a, ssl_context=ssl.create_default_context())),
            "bytes queued": Cycle(Transport(a, buffered=10)),
            "not chunked": Cycle(Transport(a), chunked_encoding=None),
            "paused": Cycle(Transport(a), flow=type("F", (), {"write_paused": True})()),
            "client gone": Cycle(Transport(a), disconnected=True),
        }
        for name, cycle in cases.items():
            stream = stream_of(cycle)
            assert not writer.attach(stream) and stream.writer_state is None, name
        ok = Cycle(Transport(a))
        assert not writer.attach(stream_of(ok, FakeSendFn))  # a send that is not uvicorn's at all

        async def wrapper(message):  # a middleware's send that might change the body
            await ok.send(message)

        assert not writer.attach(stream_of(ok, wrapper))
        stream = stream_of(ok)
        assert writer.attach(stream) and writer.open_fds == 1 and stream.writer is writer
        writer.release(stream)
        assert writer.open_fds == 0
        hub.close()
        a.close()
        b.close()

    asyncio.run(body())


async def FakeSendFn(message):  # noqa: N802 - an ASGI send that is a plain function
    pass


def test_streams_still_going_at_close_finish_from_the_loop():
    srv = StreamServer(direct_writes=True)
    try:
        n, size = 400, 200
        with httpx.Client(timeout=30) as client, client.stream("GET", srv.url + f"?n={n}&size={size}&pause=0.002") as r:
            got, parts = b"", r.iter_raw()
            for part in parts:
                got += part
                if len(got) > 20 * size and srv.hub.socket_writer._thread is not None:
                    break
            srv.loop.call_soon_threadsafe(srv.hub.close)  # (what the app's lifespan end does)
            got += b"".join(parts)
        assert got == expected(n, size)
        writer = srv.hub.socket_writer
        wait_for(lambda: not writer._thread.is_alive())
        assert writer.open_fds == 0 and not srv.aborted.is_set()
    finally:
        srv.stop()


class BusyStream:
    """A stream whose chunk is with the SocketWriter's thread: what it writes meanwhile waits."""

    def __init__(self, coalesce: bool) -> None:
        self.coalesce = coalesce
        self.failures: list[BaseException] = []
        self.writer_state = DirectState(fd=-1, transport=None)
        self.writer_state.busy = True

    def fail(self, exc: BaseException) -> None:
        self.failures.append(exc)


def test_chunks_waiting_for_the_socket_thread_are_bounded_too():
    writer = SocketWriter(AsgiWriter(), max_buffer_bytes=100)
    plain, cumulative = BusyStream(coalesce=False), BusyStream(coalesce=True)
    failed_at = None
    for k in range(5):
        if not plain.failures:  # (a failed stream is closed: the hub writes no more of it)
            writer.write(plain, b"%d" % k * 40, False)
            failed_at = k
        writer.write(cumulative, b"%d" % k * 40, k == 4)
    # the plain stream failed at its third chunk (120 bytes > 100); nothing of it stays
    assert [type(e) for e in plain.failures] == [BufferError] and writer.overflowed == 1 and failed_at == 2
    assert plain.writer_state.pending == [] and plain.writer_state.pending_size == 0
    # the cumulative one keeps only its newest chunk
    state = cumulative.writer_state
    assert cumulative.failures == [] and state.pending == [b"4" * 40] and state.pending_size == 40
    assert state.pending_final
