"""Error bodies and SSE events cannot fail on request-derived text (lone surrogates, NUL, very
long strings), and a stream that fails after it started ends with an SSE error event and
`data: [DONE]`: the render functions directly, then the real app (in process, stories260k)
with a model step made to fail mid-stream."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pyserve import ServerArgs
from pyserve.server.render import MAX_ERROR_TEXT_CHARS, error_body, json_bytes, sse_event
from tests.conftest import REPO


def test_json_bytes_escapes_lone_surrogates_and_round_trips():
    obj = {"a\udcffb": ["\ud800", "x\x00y", "é", "\\\udcff"]}
    raw = json_bytes(obj)
    raw.decode("utf-8")  # valid UTF-8
    assert json.loads(raw) == obj
    assert b"\\udcff" in raw and b"\\u0000" in raw


def test_error_body_clips_and_cleans_what_it_quotes():
    message = "model `" + "m" * 100_000 + "\udcff` not found"
    body = error_body(message, param="\udcff" * 3, code="c\udcff")
    err = body["error"]
    escaped_len = len(message) - 1 + len("\\udcff")  # the surrogate becomes its 6-character escape
    cut = f"... ({escaped_len - MAX_ERROR_TEXT_CHARS} more characters)"
    assert err["message"] == message[:MAX_ERROR_TEXT_CHARS] + cut
    assert err["param"] == "\\udcff" * 3 and err["code"] == "c\\udcff"
    json_bytes(body).decode("utf-8")
    assert sse_event(body).startswith(b"data: {") and sse_event(body).endswith(b"}\n\n")


@pytest.fixture(scope="module")
def app_and_loop(stories_path):
    from pyserve.engine.engine_core import EngineCore
    from pyserve.server.app import create_app

    args = ServerArgs(
        model_path=str(stories_path),
        max_total_tokens=2048,
        chat_template=str(REPO / "tests" / "data" / "stories_chat_template.jinja"),
    )
    app = create_app(args)
    loop = asyncio.new_event_loop()
    engine = EngineCore(args)
    loop.run_until_complete(engine.start())
    app.context.engine = engine  # what the lifespan does
    yield app, loop, engine
    loop.run_until_complete(engine.shutdown())
    loop.close()


def _post(app, loop, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            # ASCII JSON: lone surrogates travel as escapes, as any client may send them
            return await client.post(
                path, content=json.dumps(body).encode(), timeout=60, headers={"content-type": "application/json"}
            )

    return loop.run_until_complete(go())


@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/generate",
            {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 20, "ignore_eos": True},
        ),
        ("/v1/completions", {"prompt": "Lily", "stream": True, "max_tokens": 20, "ignore_eos": True, "n": 2}),
    ],
)
def test_a_stream_that_fails_midway_ends_with_an_error_event(app_and_loop, monkeypatch, path, body):
    app, loop, engine = app_and_loop
    runner = engine.model_runner
    forward = runner.forward
    calls = {"n": 0}

    def failing_on_the_fourth_step(batch):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device lost")
        return forward(batch)

    monkeypatch.setattr(runner, "forward", failing_on_the_fourth_step)
    r = _post(app, loop, path, body)
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert err == {
        "message": "model step failed: device lost",
        "type": "internal_server_error",
        "param": None,
        "code": 500,
    }
    assert len(events) > 3  # chunks came before the failure
    assert all("error" not in json.loads(e[6:]) for e in events[:-2])
    monkeypatch.setattr(runner, "forward", forward)
    ok = _post(app, loop, "/generate", {"text": "Tom", "sampling_params": {"max_new_tokens": 3}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 3
    kv = engine.kv_cache
    assert kv.protected_slots() == 0 and kv.free_slots() + kv.evictable_slots() == kv.max_total_tokens


def test_a_failed_step_without_a_stream_is_a_500_error_object(app_and_loop, monkeypatch):
    app, loop, engine = app_and_loop
    runner = engine.model_runner

    def failing(batch):
        raise RuntimeError("device lost")

    monkeypatch.setattr(runner, "forward", failing)
    r = _post(app, loop, "/v1/completions", {"prompt": "Lily", "max_tokens": 3})
    assert r.status_code == 500
    assert r.json() == {
        "error": {
            "message": "model step failed: device lost",
            "type": "internal_server_error",
            "param": None,
            "code": 500,
        }
    }


def test_lone_surrogates_anywhere_get_a_400_naming_the_field(app_and_loop):
    app, loop, _ = app_and_loop
    for path, body, param in (
        ("/v1/completions", {"model": "\udcff", "prompt": "hi"}, "model"),
        ("/v1/chat/completions", {"model": "\udcff", "messages": [{"role": "user", "content": "hi"}]}, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages.0.content"),
        ("/generate", {"text": "hi", "rid": "\udcff"}, "rid"),
        ("/generate", {"text": "hi", "sampling_params": {"stop": ["x", "\udfff"]}}, "sampling_params.stop.1"),
        ("/generate", {"text": "hi", "\udcff": 1}, None),
    ):
        r = _post(app, loop, path, body)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "not valid Unicode" in err["message"], err
    r = _post(app, loop, "/v1/completions", {"model": "m" * 50_000 + "\x00", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert len(r.json()["error"]["message"]) < 1100
