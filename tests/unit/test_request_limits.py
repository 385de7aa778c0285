"""Request limits and CORS: a body over --max-request-body-bytes gets 413 with an error object
(by its Content-Length, or counted as a chunked body arrives) and the server goes on; more
prompts than --max-prompts-per-request get 400; CORS headers only for --allowed-origins."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from pyserve.config import ServerArgs
from pyserve.server.app import create_app

LIMIT = 4096
TOO_LARGE = {
    "error": {
        "message": f"the request body is larger than {LIMIT} bytes (--max-request-body-bytes)",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
}


@pytest.fixture(scope="module")
def client(stories_path):
    args = ServerArgs(
        model_path=str(stories_path),
        max_total_tokens=2048,
        log_level="warning",
        max_request_body_bytes=LIMIT,
        max_prompts_per_request=3,
    )
    with TestClient(create_app(args)) as c:
        yield c


def test_a_body_over_the_limit_gets_413_by_length_or_as_it_arrives(client):
    big = {"text": "x" * LIMIT, "sampling_params": {"max_new_tokens": 1}}
    r = client.post("/generate", json=big)
    assert (r.status_code, r.json()) == (413, TOO_LARGE)
    data = json.dumps(big).encode()

    def chunked():  # no Content-Length: counted while it arrives
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    r = client.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()) == (413, TOO_LARGE)
    ok = client.post("/generate", json={"text": "Once", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"text": ["a", "b", "c", "d"], "sampling_params": {"max_new_tokens": 1}}, "prompt"),
        ("/generate", {"input_ids": [[1, 2]] * 4, "sampling_params": {"max_new_tokens": 1}}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b", "c", "d"], "max_tokens": 1}, "prompt"),
        ("/v1/tokenize", {"prompt": ["a", "b", "c", "d"]}, "prompt"),
    ],
)
def test_more_prompts_than_allowed_get_400(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert "at most 3 are allowed (--max-prompts-per-request)" in r.json()["error"]["message"]
    three = {**body}
    key = next(k for k in ("text", "input_ids", "prompt") if k in body)
    three[key] = body[key][:3]
    assert client.post(path, json=three).status_code == 200


def test_no_cors_headers_unless_origins_are_allowed(client, stories_path):
    r = client.get("/health", headers={"Origin": "https://example.com"})
    assert "access-control-allow-origin" not in r.headers
    args = ServerArgs(
        model_path=str(stories_path),
        max_total_tokens=256,
        log_level="warning",
        allowed_origins=["https://example.com"],
        api_key="k",
    )
    with TestClient(create_app(args)) as c:
        pre = c.options(
            "/v1/chat/completions",
            headers={"Origin": "https://example.com", "Access-Control-Request-Method": "POST"},
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://example.com"
        denied = c.get("/v1/models", headers={"Origin": "https://example.com"})  # no key: 401, readable
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "https://example.com"
        other = c.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
