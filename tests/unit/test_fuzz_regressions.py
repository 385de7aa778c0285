"""Inputs the schemathesis run (tests/e2e/test_openapi_fuzz.py) found answered with a 5xx, each
now answered as it should be."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from pyserve.config import ServerArgs
from pyserve.server.app import create_app
from pyserve.server.render import json_bytes
from tests.conftest import CHAT_TEMPLATE

BIG = 2**70  # valid JSON, beyond the 64 bits orjson writes


@pytest.fixture(scope="module")
def client(stories_path):
    args = ServerArgs(
        model_path=str(stories_path), chat_template=str(CHAT_TEMPLATE), max_total_tokens=2048, log_level="warning"
    )
    with TestClient(create_app(args)) as c:
        yield c


def test_json_bytes_writes_integers_beyond_64_bits():
    assert (
        json_bytes({"n": BIG, "m": -(2**80), "k": 1})
        == b'{"n":1180591620717411303424,"m":-1208925819614629174706176,"k":1}'
    )
    # with a lone surrogate too (the other standard-library case)
    raw = json_bytes({"\udcff": BIG})
    assert raw == b'{"\\udcff":1180591620717411303424}'
    assert json.loads(raw) == {"\udcff": BIG}


def test_responses_echo_big_integers(client):
    """/v1/responses echoes `metadata` and `max_tool_calls` in its Response object: an integer
    beyond 64 bits there was a 500 ("Integer exceeds 64-bit range"), streamed an error event."""
    body = {
        "input": "Once",
        "max_output_tokens": 2,
        "temperature": 0,
        "metadata": {"k": BIG, "nested": [{"m": -BIG}]},
        "max_tool_calls": BIG,
    }
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["metadata"] == {"k": BIG, "nested": [{"m": -BIG}]}
    assert out["max_tool_calls"] == BIG
    assert out["status"] == "incomplete"
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.incomplete"
    assert events[0]["response"]["metadata"] == events[-1]["response"]["metadata"] == body["metadata"]


def test_min_new_tokens_beyond_int64_is_a_400(client):
    """A min_new_tokens (OpenAI: min_tokens) beyond int64 failed the model step (500 "Python
    int too large to convert to C long": the worker's rows are int64); now a 400 naming it."""
    body = {"text": "Once", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 2**63}}
    for stream in (False, True):
        r = client.post("/generate", json={**body, "stream": stream})
        assert r.status_code == 400
        assert r.json() == {
            "error": {
                "message": "sampling_params.min_new_tokens: Input should be less than or equal to 9223372036854775807",
                "type": "invalid_request_error",
                "param": "sampling_params.min_new_tokens",
                "code": None,
            }
        }
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "min_tokens": 2**64}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "min_tokens"
    r = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, "min_tokens": 2**70})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "min_tokens"
    # the largest int64 is served: it only holds the stop tokens back for the whole output
    body["sampling_params"]["min_new_tokens"] = 2**63 - 1
    r = client.post("/generate", json=body)
    assert r.status_code == 200
    assert r.json()["meta_info"]["completion_tokens"] == 2
