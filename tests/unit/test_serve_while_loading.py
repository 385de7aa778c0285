"""`pyserve serve` answers while its model loads: `/health` 503 {"status": "loading"}, the
routes that need the model 503 with an error object and Retry-After; then the model serves.
A model that fails to load ends the server with exit status 1."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

from starlette.testclient import TestClient

from pyserve.config import ServerArgs
from pyserve.engine.engine_core import EngineCore
from pyserve.server.app import create_app
from tests.conftest import free_port


def test_routes_answer_503_while_loading_then_serve(stories_path, monkeypatch):
    release = threading.Event()
    original_start = EngineCore.start

    async def held_start(self):
        while not release.is_set():  # the load waits for the test
            await asyncio.sleep(0.01)
        await original_start(self)

    monkeypatch.setattr(EngineCore, "start", held_start)
    args = ServerArgs(model_path=str(stories_path), max_total_tokens=2048, log_level="warning")
    app = create_app(args, load_in_background=True)
    with TestClient(app) as client:
        r = client.get("/health")
        assert (r.status_code, r.json(), r.headers["retry-after"]) == (503, {"status": "loading"}, "1")
        for method, path, body in [
            ("POST", "/generate", {"text": "a"}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
            ("GET", "/v1/models", None),
            ("GET", "/server_info", None),
        ]:
            r = client.request(method, path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", path
            assert r.json() == {
                "error": {
                    "message": "the model is still loading; retry shortly",
                    "type": "server_error",
                    "param": None,
                    "code": "model_loading",
                }
            }, path
        release.set()
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = client.post("/generate", json={"text": "Once", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4


def test_a_model_that_fails_to_load_ends_the_server_with_status_1(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no weights, no tokenizer
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyserve",
            "serve",
            "--model-path",
            str(folder),
            "--port",
            str(free_port()),
            "--log-level",
            "warning",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the model failed to load" in proc.stderr
