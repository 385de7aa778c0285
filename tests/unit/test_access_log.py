"""One access-log line per request (pyserve.server.access_log), from the real app in process
on stories260k: method, path, status, latency, the prompt and completion tokens the response's
usage reports, the request id; a 4xx's message; a 500 logged once with its traceback and not
raised on to the ASGI server; the polled routes at debug; `--disable-log-requests` off."""

from __future__ import annotations

import json
import logging
import re

import pytest
from starlette.requests import Request
from starlette.routing import Route
from starlette.testclient import TestClient

from pyserve.config import ServerArgs
from pyserve.server.access_log import AccessRecord, access_line, error_message
from pyserve.server.app import create_app
from tests.conftest import CHAT_TEMPLATE

LATENCY = r"\d+\.\d ms"


def _args(stories_path, **kwargs) -> ServerArgs:
    return ServerArgs(
        model_path=str(stories_path),
        max_total_tokens=2048,
        chat_template=str(CHAT_TEMPLATE),
        log_level="warning",
        stats_interval_s=3600.0,
        **kwargs,
    )


async def _boom(request: Request) -> None:
    raise RuntimeError("boom")


@pytest.fixture(scope="module")
def client(stories_path):
    app = create_app(_args(stories_path))
    app.router.routes.append(Route("/boom", _boom, methods=["GET"]))
    with TestClient(app) as c:
        yield c


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pyserve.access"]


def test_a_generate_request_logs_its_usage_and_rid(client, caplog):
    caplog.set_level(logging.INFO, logger="pyserve.access")
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    assert meta["completion_tokens"] == 8
    (line,) = access_lines(caplog)
    want = f"POST /generate 200 {LATENCY} prompt_tokens={meta['prompt_tokens']} completion_tokens=8 rid={meta['id']}"
    assert re.fullmatch(want, line), line


def test_a_streamed_generate_request_logs_its_final_counts(client, caplog):
    caplog.set_level(logging.INFO, logger="pyserve.access")
    body = {"text": "Tom had", "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    with client.stream("POST", "/generate", json=body) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    meta = json.loads(events[-2].removeprefix("data: "))["meta_info"]
    (line,) = access_lines(caplog)
    want = f"POST /generate 200 {LATENCY} prompt_tokens={meta['prompt_tokens']} completion_tokens=6 rid={meta['id']}"
    assert re.fullmatch(want, line), line


def test_a_chat_request_logs_the_usage_it_answers(client, caplog):
    caplog.set_level(logging.INFO, logger="pyserve.access")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "n": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    usage, rid = r.json()["usage"], r.json()["id"].removeprefix("chatcmpl-")
    assert usage["completion_tokens"] == 10
    (line,) = access_lines(caplog)
    want = (
        f"POST /v1/chat/completions 200 {LATENCY} prompt_tokens={usage['prompt_tokens']} completion_tokens=10 "
        f"rid={re.escape(rid)}-0"
    )
    assert re.fullmatch(want, line), line


def test_a_4xx_logs_its_message(client, caplog):
    caplog.set_level(logging.INFO, logger="pyserve.access")
    r = client.post("/generate", json={"text": "a", "sampling_params": {"temperatur": 0.5}})
    assert r.status_code == 400
    message = "Unrecognized request argument supplied: sampling_params.temperatur"
    assert r.json()["error"]["message"] == message
    r = client.get("/v1/models/nope")
    assert r.status_code == 404
    lines = access_lines(caplog)
    assert len(lines) == 2
    assert re.fullmatch(f"POST /generate 400 {LATENCY} rid=- error: {re.escape(message)}", lines[0]), lines[0]
    not_found = re.escape(r.json()["error"]["message"])
    assert re.fullmatch(f"GET /v1/models/nope 404 {LATENCY} rid=- error: {not_found}", lines[1]), lines[1]


def test_a_500_is_logged_once_with_its_traceback_and_answered(client, caplog):
    caplog.set_level(logging.INFO, logger="pyserve.access")
    r = client.get("/boom")  # (TestClient raises what reaches the ASGI server: nothing does)
    assert (r.status_code, r.json()["error"]["message"]) == (500, "internal server error: RuntimeError: boom")
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert [(rec.name, rec.getMessage()) for rec in errors] == [
        ("pyserve.server.errors", "internal error on GET /boom rid=-")
    ]
    assert errors[0].exc_info is not None and str(errors[0].exc_info[1]) == "boom"
    (line,) = access_lines(caplog)
    assert re.fullmatch(f"GET /boom 500 {LATENCY} rid=- error: internal server error: RuntimeError: boom", line)


def test_polled_routes_log_at_debug_only(client, caplog):
    caplog.set_level(logging.INFO, logger="pyserve.access")
    assert client.get("/health").status_code == 200
    assert access_lines(caplog) == []
    caplog.set_level(logging.DEBUG, logger="pyserve.access")
    assert client.get("/health").status_code == 200
    (record,) = [r for r in caplog.records if r.name == "pyserve.access"]
    assert record.levelno == logging.DEBUG
    assert re.fullmatch(f"GET /health 200 {LATENCY} rid=-", record.getMessage())


def test_disable_log_requests_writes_no_line(stories_path, caplog):
    caplog.set_level(logging.DEBUG, logger="pyserve.access")
    app = create_app(_args(stories_path, disable_log_requests=True))
    with TestClient(app) as c:
        r = c.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
        assert c.post("/generate", json={"nope": 1}).status_code == 400
    assert access_lines(caplog) == []


def test_the_line_of_a_response_that_never_started_or_was_cut():
    record = AccessRecord()
    line = access_line("POST", "/generate", record)
    assert re.fullmatch(f"POST /generate - {LATENCY} rid=- \\(no response: the client left\\)", line), line
    record.status, record.rid, record.prompt_tokens, record.completion_tokens = 200, "r1", 3, 4
    line = access_line("POST", "/generate", record)
    cut = "\\(cut short: the client left or the server stopped\\)"
    assert re.fullmatch(f"POST /generate 200 {LATENCY} prompt_tokens=3 completion_tokens=4 rid=r1 {cut}", line), line
    assert error_message(b"plain\ntext") == "plain text"
    assert error_message(b'{"error": {"message": "m"}}') == "m"
    assert error_message(b"") == "(no body)"


def test_request_text_cannot_forge_a_log_line():
    record = AccessRecord()
    record.status = 404
    record.error_body = b'{"error": {"message": "The model `x\\nINFO pyserve.access: GET / 200` does not exist"}}'
    line = access_line("GET", "/v1/\nINFO pyserve.access: GET /ok 200", record)
    assert "\n" not in line
    assert line.startswith("GET /v1/%0AINFO%20pyserve.access:%20GET%20/ok%20200 404 ")
    assert line.endswith(" rid=- error: The model `x INFO pyserve.access: GET / 200` does not exist")
    assert error_message(b"x" * 1000) == "x" * 300
