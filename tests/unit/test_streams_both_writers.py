"""Every streaming route through the one stream hub, with each writer: the pyserve app on a real
uvicorn (HTTP1Protocol, uvloop) whose streams go to the socket writer thread ("socket") or,
with it turned off, to the ASGI send ("asgi"); the device is simulated (seeded ids, never EOS,
stories260k's tokenizer). Native /generate, OpenAI chat and completions, n > 1, a model step
failing after the 200, a client leaving mid-stream (its KV freed) and a reader too slow for
its socket (the others go on) give the same events on both. The socket runs also pin what the
writer reads of uvicorn's private request cycle (pyproject's uvicorn range)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from pyserve.config import ServerArgs
from pyserve.model_executor.simulated_runner import SimulatedRunner
from pyserve.model_loader.tokenizer import get_tokenizer
from pyserve.server import socket_writer
from pyserve.server.app import create_app
from pyserve.server.http1 import HTTP1Protocol
from pyserve.server.stream_hub import StreamHub
from tests.conftest import CHAT_TEMPLATE, free_port, wait_idle

CONTEXT_LEN = 4096
POOL = 16384


class Served:
    """create_app on a SimulatedRunner behind uvicorn, on a thread of its own."""

    def __init__(self, stories_path, writer: str) -> None:
        tok = get_tokenizer(str(stories_path))
        self.runner = SimulatedRunner(
            len(tok), {tok.eos_token_id}, POOL, CONTEXT_LEN, decode_base_ms=1.0, extend_us_per_token=1.0
        )
        self.port = free_port()
        args = ServerArgs(
            model_path=str(stories_path),
            port=self.port,
            max_total_tokens=POOL,
            chat_template=str(CHAT_TEMPLATE),
            log_level="warning",
            stats_interval_s=3600.0,
        )
        self.app = create_app(args, model_runner=self.runner)
        self.writer = writer
        if writer == "asgi":
            self.app.context.stream_hub = StreamHub(socket_writes=False)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, loop="uvloop", http=HTTP1Protocol, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def hub(self) -> StreamHub:
        return self.app.context.stream_hub

    def stream(self, path: str, body: dict) -> tuple[int, list]:
        """Status and the SSE events of one streamed request (JSON, or the [DONE] string)."""
        with httpx.Client(timeout=60) as client:
            r = client.post(self.url + path, json=body)
        events = [e for e in r.text.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events), r.text
        return r.status_code, [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module", params=["socket", "asgi"])
def served(request, stories_path):
    srv = Served(stories_path, request.param)
    find = socket_writer.uvicorn_cycle
    cycles: list = []

    def recording(receive, send):  # what the writer took, to check uvicorn's attributes
        cycle = find(receive, send)
        cycles.append(cycle)
        return cycle

    socket_writer.uvicorn_cycle = recording
    srv.cycles = cycles
    try:
        yield srv
        info = wait_idle(srv.url)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL
    finally:
        socket_writer.uvicorn_cycle = find
        srv.stop()


def sent_by_thread(served, before: int) -> None:
    """The socket runs' streams went through the writer thread; the asgi runs' never."""
    if served.writer == "socket":
        assert served.hub.socket_writer.chunks_sent > before
    else:
        assert served.hub.socket_writer is None


def chunks_sent(served) -> int:
    return served.hub.socket_writer.chunks_sent if served.writer == "socket" else 0


def test_native_stream(served):
    before = chunks_sent(served)
    status, events = served.stream(
        "/generate",
        {"text": "Once upon", "stream": True, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}},
    )
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 13))
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == list(range(1, 13))
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    sent_by_thread(served, before)


def test_chat_stream_with_usage(served):
    before = chunks_sent(served)
    status, events = served.stream(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "max_tokens": 10,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200 and events[-1] == "[DONE]"
    first, usage = events[0], events[-2]
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    deltas = events[1:-3]
    assert all(
        set(e["choices"][0]["delta"]) == {"content"} and e["choices"][0]["finish_reason"] is None for e in deltas
    )
    assert events[-3]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert len({e["id"] for e in events[:-1]}) == 1 and first["id"].startswith("chatcmpl-")
    sent_by_thread(served, before)


def test_completions_stream_with_two_samples(served):
    before = chunks_sent(served)
    status, events = served.stream(
        "/v1/completions",
        {
            "prompt": "Lily",
            "stream": True,
            "max_tokens": 6,
            "ignore_eos": True,
            "n": 2,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200 and events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"] == "length")
    assert finished == [0, 1]
    assert usage["usage"]["completion_tokens"] == 12 and usage["usage"]["prompt_tokens"] > 0
    sent_by_thread(served, before)


def test_native_stream_with_two_samples(served):
    status, events = served.stream(
        "/generate",
        {"text": "Tom", "stream": True, "sampling_params": {"max_new_tokens": 5, "n": 2, "ignore_eos": True}},
    )
    assert status == 200 and events[-1] == "[DONE]"
    finals = sorted((e["index"], len(e["output_ids"])) for e in events[:-1] if e["meta_info"]["finish_reason"])
    assert finals == [(0, 5), (1, 5)]


def test_an_invalid_request_is_an_error_response_before_the_stream(served):
    for path, body in (
        ("/generate", {"input_ids": [10**6], "stream": True}),
        ("/generate", {"input_ids": [10**6], "stream": True, "sampling_params": {"n": 2}}),
        ("/v1/completions", {"prompt": [10**6], "stream": True}),
    ):
        r = httpx.post(served.url + path, json=body, timeout=60)
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], (path, r.text)


def test_a_failed_step_after_the_200_ends_with_an_error_event(served):
    runner = served.runner
    forward, calls = runner.forward, {"n": 0}

    def failing_on_the_fourth_step(batch):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device lost")
        return forward(batch)

    runner.forward = failing_on_the_fourth_step
    try:
        status, events = served.stream(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 20, "ignore_eos": True},
        )
    finally:
        runner.forward = forward
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2] == {
        "error": {
            "message": "model step failed: device lost",
            "type": "internal_server_error",
            "param": None,
            "code": 500,
        }
    }
    assert all("error" not in e for e in events[:-2]) and len(events) > 3


def test_a_client_that_leaves_mid_stream_frees_its_kv(served):
    body = json.dumps(
        {"text": "The dog", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    ).encode()
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = b""
        while got.count(b"data: ") < 20:
            got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200")
    info = wait_idle(served.url)  # aborted: nothing runs, nothing holds KV
    assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL


def test_a_slow_reader_holds_up_no_other_stream(served):
    diverted = served.hub.socket_writer.diverted if served.writer == "socket" else 0
    slow_body = {"text": "Lily", "stream": True, "sampling_params": {"max_new_tokens": 2500, "ignore_eos": True}}
    with httpx.Client(timeout=120) as client, client.stream("POST", served.url + "/generate", json=slow_body) as slow:
        # not read: its cumulative events (about 25 MB in all) fill the socket buffers, its
        # bytes wait in the server's transport and its request pauses; other streams come and go
        while not httpx.get(served.url + "/get_server_info").json()["num_paused_reqs"]:
            time.sleep(0.05)
        if served.writer == "socket":
            assert served.hub.socket_writer.diverted == diverted + 1  # the socket writer gave it up
        for _ in range(3):  # other streams come and go meanwhile
            status, events = served.stream(
                "/generate",
                {"text": "Tom", "stream": True, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}},
            )
            assert status == 200 and events[-1] == "[DONE]" and len(events[-2]["output_ids"]) == 8
        info = httpx.get(served.url + "/get_server_info").json()
        assert info["num_paused_reqs"] == 1 and info["num_running_reqs"] == 1
        text = slow.read().decode()  # read: it resumes and runs to its end
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    # each native chunk holds all before it: those that waited behind the slow write were
    # replaced by the newest (the stream stayed within --max-stream-buffer-bytes), in order
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths[0] == 1 and lengths[-1] == 2500 and lengths == sorted(set(lengths)) and len(lengths) < 2500
    final = chunks[-1]
    assert all(final["output_ids"][: len(c["output_ids"])] == c["output_ids"] for c in chunks)
    assert all(final["text"].startswith(c["text"]) for c in chunks)


def test_the_writer_read_uvicorns_request_cycle(served):
    """What SocketWriter reads of uvicorn's httptools RequestResponseCycle exists, with the types
    it expects (a uvicorn release that changes them fails here, not in production)."""
    if served.writer != "socket":
        pytest.skip("the socket writer only")
    served.stream("/generate", {"text": "Tom", "stream": True, "sampling_params": {"max_new_tokens": 3}})
    cycles = [c for c in served.cycles if c is not None]
    assert cycles and len(cycles) == len(served.cycles)  # every stream's cycle was found
    cycle = cycles[-1]
    assert type(cycle).__name__ == "RequestResponseCycle"
    assert type(cycle).__module__ == socket_writer.UVICORN_CYCLE_MODULE
    assert isinstance(cycle.chunked_encoding, bool) and isinstance(cycle.disconnected, bool)
    assert isinstance(cycle.response_complete, bool) and isinstance(cycle.flow.write_paused, bool)
    assert isinstance(cycle.scope, dict) and cycle.scope["scheme"] == "http"
    for name in ("is_closing", "get_write_buffer_size", "get_extra_info", "write"):
        assert callable(getattr(cycle.transport, name))
    assert served.hub.socket_writer.open_fds == 0
