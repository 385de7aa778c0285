"""Structured output that holds on a model that favours whitespace: stories260k (whose likeliest
token inside JSON is often a newline) behind real servers with the default JSON whitespace
bound, on both grammar backends; and a reasoning parser's thinking before a constrained answer,
ended by the thinking budget when the model never closes it.

Every reply is checked for the bound: no whitespace run between JSON tokens longer than
MAX_JSON_WHITESPACE."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from pyserve.constrained import MAX_JSON_WHITESPACE
from tests.conftest import stories_chat_server
from tests.e2e.test_schema_corpus import longest_whitespace_run as longest_gap
from tests.e2e.test_tool_calls_stories import MESSAGES, PARAMS, TEMPLATE, TOOLS, check_calls, run_all

# a closed schema whose shortest instance is 12 characters, `{"ok": true}` (at most 30 with
# its longest value and whitespace kept to one space a gap)
CLOSED = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Lily", "Tom"]},
        "age": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["name", "age"],
}


def test_longest_gap_reads_strings_and_escapes():
    assert longest_gap('{ "a b  c":\n\n 1}') == 3
    assert longest_gap('["x\\"   ", 2]') == 1
    assert longest_gap("[]") == 0


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def server(request, tmp_path_factory, stories_path):
    yield from stories_chat_server(
        tmp_path_factory,
        stories_path,
        f"ws-{request.param}",
        8192,
        ["--chat-template", str(TEMPLATE), "--tool-call-parser", "qwen25", "--grammar-backend", request.param],
    )


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_parse_with_whitespace_on(server, choice):
    allowed = {"get_time"} if choice == "named" else set(PARAMS)
    base = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}} if choice == "named" else "required",
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "max_tokens": 200,
    }
    plain = run_all(server, [{**base, "seed": s} for s in range(50)])
    streamed = run_all(server, [{**base, "seed": s, "stream": True} for s in range(50)])
    for p, s in zip(plain, streamed):
        assert len(check_calls(p, allowed)) == 1
        assert check_calls(s, allowed) == check_calls(p, allowed)


def test_the_raw_forced_calls_keep_the_bound(server):
    """The forced calls' text as the model wrote it (separate_reasoning and the parser are the
    chat route's; /v1/completions with the same grammar shows the raw text)."""
    schema = {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"name": {"const": "get_time"}, "parameters": PARAMS["get_time"]},
            "required": ["name", "parameters"],
        },
        "minItems": 1,
        "maxItems": 1,
    }
    bodies = [
        {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 1.0, "seed": s, "json_schema": schema}
        for s in range(20)
    ]
    for body in bodies:
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), schema)
        assert longest_gap(choice["text"]) <= MAX_JSON_WHITESPACE


@pytest.mark.parametrize("stream", [False, True])
def test_a_closed_schema_finishes_with_stop(server, stream):
    base = {
        "messages": MESSAGES,
        "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": CLOSED}},
    }
    replies = run_all(server, [{**base, "seed": s, "stream": stream} for s in range(50)])
    for reply in replies:
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        content = choice["message"]["content"]
        jsonschema.validate(json.loads(content), CLOSED)
        assert longest_gap(content) <= MAX_JSON_WHITESPACE


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def r1_server(request, tmp_path_factory, stories_path):
    yield from stories_chat_server(
        tmp_path_factory,
        stories_path,
        f"r1-{request.param}",
        8192,
        ["--reasoning-parser", "deepseek-r1", "--grammar-backend", request.param],
    )


def test_json_after_thinking_that_the_budget_ends(r1_server):
    """stories260k never writes `</think>` by itself: the budget ends the thinking after 16
    tokens, and the answer follows the schema, streamed or not."""
    base = {
        "messages": MESSAGES,
        "temperature": 1.0,
        "max_tokens": 160,
        "thinking_budget": 16,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    }
    plain = run_all(r1_server, [{**base, "seed": s} for s in range(10)])
    streamed = run_all(r1_server, [{**base, "seed": s, "stream": True} for s in range(10)])
    for p, s in zip(plain, streamed):
        choice = p["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        message = choice["message"]
        jsonschema.validate(json.loads(message["content"]), PERSON)
        assert message["reasoning_content"]  # it thought first
        assert "</think>" not in message["reasoning_content"] + message["content"]
        assert s["choices"][0]["message"] == message


def test_the_default_budget_is_half_of_max_tokens(r1_server):
    body = {
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 200,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    }
    (reply,) = run_all(r1_server, [body])
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    tokens = httpx.post(
        r1_server.base_url + "/v1/tokenize",
        json={"prompt": choice["message"]["reasoning_content"], "add_special_tokens": False},
        timeout=60,
    ).json()["tokens"]
    assert len(tokens) <= 100


def test_a_budget_alone_bounds_the_thinking(r1_server):
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 60, "thinking_budget": 8}
    (reply,) = run_all(r1_server, [body])
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"]  # the thinking ended; an answer followed
    r = httpx.post(r1_server.base_url + "/v1/chat/completions", json={**body, "thinking_budget": -1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_budget"
