"""`--api-key`: every route but /health*, /metrics, the browser pages and OPTIONS answers 401
with an error object without the key; the right key works (streams included); the key is
never reported."""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from pyserve.config import ServerArgs
from pyserve.server import native, parse_routes, tokenize
from pyserve.server.app import create_app
from pyserve.server.auth import EXEMPT_PATHS
from pyserve.server.openai import embeddings, serving
from tests.conftest import CHAT_TEMPLATE, ServerProcess

KEY = "sk-test-\u00e9-key"  # (non-ASCII: compared as UTF-8 bytes)
AUTH = {"Authorization": f"Bearer {KEY}".encode()}
BODIES = {
    "/generate": {"text": "Once", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    "/abort_request": {"abort_all": True},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "Once", "max_tokens": 2},
    "/v1/tokenize": {"prompt": "Once"},
    "/tokenize": {"prompt": "Once"},
    "/v1/detokenize": {"tokens": [1, 2]},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/v1/embeddings": {"input": "hi"},
    "/encode": {"text": "hi"},
    "/separate_reasoning": {"text": "<think>a</think>b", "reasoning_parser": "qwen3"},
    "/parse_function_call": {
        "text": "hi",
        "tool_call_parser": "qwen25",
        "tools": [{"type": "function", "function": {"name": "f"}}],
    },
}
# what the key holder gets there from this (generation) server: a 400, past the key check
# what this server (a dense generator) answers with 400 to the key holder
REFUSED_HERE = (
    "/v1/embeddings",
    "/encode",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
)
UNAUTHORIZED = {
    "error": {
        "message": "a valid API key is required: send `Authorization: Bearer <key>`",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


def route_calls() -> list[tuple[str, str]]:
    """(method, path) of every route of the app (path parameters filled in)."""
    out = []
    for route in create_app(ServerArgs()).routes:
        path = route.path.replace("{model_id:path}", "default").replace("{response_id:path}", "resp_1")
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                out.append((method, path))
    return out


@pytest.fixture(scope="module")
def client(stories_path):
    args = ServerArgs(
        model_path=str(stories_path),
        chat_template=str(CHAT_TEMPLATE),
        max_total_tokens=2048,
        log_level="warning",
        api_key=KEY,
    )
    with TestClient(create_app(args)) as c:
        yield c


@pytest.mark.parametrize(("method", "path"), route_calls())
def test_every_protected_route_needs_the_key(client, method, path):
    body = BODIES.get(path) if method == "POST" else None
    exempt = path.startswith("/health") or path in EXEMPT_PATHS  # (/metrics and the browser pages)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY.encode()}):
        r = client.request(method, path, json=body, headers=headers)
        if exempt:
            assert r.status_code == 200, path
        else:
            assert (r.status_code, r.json(), r.headers["www-authenticate"]) == (401, UNAUTHORIZED, "Bearer"), path
    r = client.request(method, path, json=body, headers=AUTH)
    # (no response is stored: /v1/responses/{id} answers 400 "not supported" to the key holder)
    refused = path.startswith("/v1/responses/") or path in REFUSED_HERE
    assert r.status_code == (400 if refused else 200), (path, r.text)


def test_the_route_table_holds_every_route_module():
    paths = {p for _, p in route_calls()}
    modules = native.ROUTES + parse_routes.ROUTES + serving.ROUTES + tokenize.ROUTES + embeddings.ROUTES
    assert {r.path.replace("{model_id:path}", "default") for r in modules} <= paths
    assert {"/metrics", "/v1/responses"} <= paths


def test_options_is_exempt_and_the_key_is_never_reported(client):
    assert client.options("/v1/chat/completions").status_code != 401
    info = client.get("/server_info", headers=AUTH).json()
    assert "api_key" not in info and KEY not in str(info)
    assert KEY not in repr(ServerArgs(api_key=KEY))


def test_the_environment_key_and_a_streamed_reply_through_a_real_server(stories_path, tmp_path, monkeypatch):
    """PYSERVE_API_KEY guards `pyserve serve`; a stream with the key goes through the writer."""
    monkeypatch.setenv("PYSERVE_API_KEY", "env-key")
    server = ServerProcess(["--model-path", str(stories_path), "--max-total-tokens", "2048"], tmp_path / "log")
    try:
        server.wait_ready()
        url = server.base_url + "/generate"
        assert httpx.post(url, json=BODIES["/generate"]).status_code == 401
        body = {**BODIES["/generate"], "stream": True}
        with httpx.stream("POST", url, json=body, headers={"Authorization": "Bearer env-key"}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) == 3
    finally:
        server.stop()
