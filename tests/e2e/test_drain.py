"""Graceful drain, end to end on SmolLM2: SIGTERM during 16 streams and a whole response.
Requests sent after the signal get 503; the streams that finish within --shutdown-timeout-s end
as usual, the others with finish reason abort; every stream ends with `data: [DONE]`; the cut
whole response gets a 503 error object; no traceback in the log; the server exits with 0."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import httpx

from tests.conftest import ServerProcess

SHORT, LONG = 4, 2000  # max_new_tokens: done within the timeout, cut by it


def _stream(url: str, max_new_tokens: int, lines: list[str]) -> None:
    body = {
        "text": "Once upon a time",
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)


def _whole(url: str) -> httpx.Response:
    body = {"text": "Once", "sampling_params": {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True}}
    return httpx.post(url + "/generate", json=body, timeout=300)


def test_sigterm_drains_16_streams(tmp_path):
    server = ServerProcess(["--shutdown-timeout-s", "3", "--max-running-requests", "17"], tmp_path / "server.log")
    try:
        server.wait_ready()
        streams: list[list[str]] = [[] for _ in range(16)]
        threads = [
            threading.Thread(target=_stream, args=(server.base_url, SHORT if i % 2 else LONG, streams[i]))
            for i in range(16)
        ]
        whole: list[httpx.Response] = []
        threads.append(threading.Thread(target=lambda: whole.append(_whole(server.base_url))))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while not all(len(s) >= 2 for s in streams[::2]):  # the long ones are decoding
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # (the drain starts on the server's next 0.1 s tick)
        r = httpx.post(server.base_url + "/generate", json={"text": "a"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        r = httpx.get(server.base_url + "/health", timeout=30)
        assert (r.status_code, r.json()) == (503, {"status": "draining"})
        for t in threads:
            t.join(timeout=120)
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    for i, lines in enumerate(streams):
        assert lines[-1] == "data: [DONE]", (i, lines[-3:])
        last = json.loads(lines[-2].removeprefix("data: "))
        reason = last["meta_info"]["finish_reason"]
        if i % 2:
            assert reason == {"type": "length", "length": SHORT}, (i, reason)
        else:
            assert reason["type"] == "abort" and reason["message"] == "server shutting down", (i, reason)
            assert 1 <= last["meta_info"]["completion_tokens"] < LONG
    (r,) = whole  # a whole response cut by the drain: a 503 error object
    assert r.status_code == 503 and r.json()["error"] == {
        "message": "the server is shutting down",
        "type": "server_error",
        "param": None,
        "code": "server_shutting_down",
    }
    log = server.log_path.read_text()
    assert "Traceback" not in log and "drain: 9 requests still running after 3 s are ended" in log


def test_a_second_signal_exits_at_once(tmp_path, stories_path):
    """A drain with a long timeout and a long queue (one request runs at a time): the second
    SIGTERM ends the server within seconds, not after the timeout."""
    args = ["--model-path", str(stories_path), "--shutdown-timeout-s", "300", "--max-running-requests", "1"]
    server = ServerProcess(args, tmp_path / "s.log")
    try:
        server.wait_ready()
        body = {"text": "Once", "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}

        def request() -> None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(server.base_url + "/generate", json=body, timeout=120)

        threads = [threading.Thread(target=request, daemon=True) for _ in range(40)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while httpx.get(server.base_url + "/get_server_info").json()["num_waiting_reqs"] < 20:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert server.proc.poll() is None  # draining: 20+ requests of ~1 s each still to go
        server.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        server.proc.wait(timeout=15)
        assert time.monotonic() - started < 10
    finally:
        server.stop()
