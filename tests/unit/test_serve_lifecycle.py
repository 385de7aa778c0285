"""What `pyserve serve` says and does over its life, in a real process on stories260k: one ready
line once the model serves (address, model, device, dtype, KV cache), an access line for a
stream written by the socket writer (its tokens and request id), a first Ctrl-C that drains,
and a second that exits at once with status 130 and one line, no traceback; Ctrl-C while the
model loads exits at once too (status 130), releasing the port."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import threading
import time

import httpx

from tests.conftest import ServerProcess


def wait_for(server: ServerProcess, text: str, timeout_s: float = 300.0) -> None:
    """Until `text` is in the server's output (AssertionError if it exits or times out)."""
    deadline = time.monotonic() + timeout_s
    while text not in server.log():
        assert server.proc.poll() is None, server.log()
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)


def _stream(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
        return [line for line in r.iter_lines() if line]


def test_ready_line_access_line_and_a_second_ctrl_c(tmp_path, stories_path):
    args = ["--model-path", str(stories_path), "--max-total-tokens", "4096", "--max-running-requests", "1"]
    server = ServerProcess([*args, "--shutdown-timeout-s", "300"], tmp_path / "serve.log")
    try:
        wait_for(server, "pyserve ready on ")
        info = httpx.get(server.base_url + "/get_server_info", timeout=30).json()
        kv = f"KV cache 4,096 tokens ({info['kv_cache_bytes'] / 2**20:.1f} MiB)"
        ready = f"pyserve ready on {server.base_url}: stories260k on cpu (float32), {kv}"
        assert [line.split(": ", 1)[1] for line in server.log().splitlines() if "pyserve ready on" in line] == [ready]

        events = _stream(server.base_url, {"text": "Once", "stream": True, "sampling_params": {"max_new_tokens": 5}})
        meta = json.loads(events[-2].removeprefix("data: "))["meta_info"]
        wait_for(server, f"rid={meta['id']}")
        (line,) = [x for x in server.log().splitlines() if "pyserve.access: POST /generate" in x]
        tokens = f"prompt_tokens={meta['prompt_tokens']} completion_tokens=5 rid={meta['id']}"
        assert re.search(rf"INFO pyserve\.access: POST /generate 200 \d+\.\d ms {tokens}$", line), line

        # one request runs at a time: the drain has several long ones to wait for
        body = {"text": "Once", "stream": True, "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}

        def cut_stream() -> None:  # (the second Ctrl-C cuts it)
            with contextlib.suppress(httpx.HTTPError):
                _stream(server.base_url, body)

        streams = [threading.Thread(target=cut_stream, daemon=True) for _ in range(8)]
        for t in streams:
            t.start()
        deadline = time.monotonic() + 60
        while httpx.get(server.base_url + "/get_server_info", timeout=30).json()["num_waiting_reqs"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGINT)
        wait_for(server, "shutting down: running requests may finish")
        assert server.proc.poll() is None  # draining
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=30) == 130
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert "Traceback" not in log
    assert log.endswith("\npyserve: second interrupt, exiting now\n"), log[-2000:]


def test_ctrl_c_while_the_model_loads_exits_at_once(tmp_path, stories_path):
    """A model whose (random) weights take seconds to make: Ctrl-C once it loads."""
    model = tmp_path / "big"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((stories_path / name).read_bytes())
    config = json.loads((stories_path / "config.json").read_text())
    config.update(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, head_dim=64,
        num_key_value_heads=8,
    )  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    server = ServerProcess(["--model-path", str(model), "--load-format", "dummy"], tmp_path / "serve.log")
    try:
        wait_for(server, "loading model from")
        r = httpx.get(server.base_url + "/health", timeout=30)
        assert (r.status_code, r.json()) == (503, {"status": "loading"})
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=10) == 130
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert "Traceback" not in log and "pyserve ready" not in log
    assert log.endswith("\npyserve: interrupt while the model loads, exiting now\n"), log[-2000:]
    with socket.socket() as again:  # the port is free (bound as the server binds it)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", server.port))
