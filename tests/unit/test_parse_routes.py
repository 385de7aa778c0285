"""SGLang's /separate_reasoning and /parse_function_call: exact answers in SGLang's shapes for
every parser, calls to functions the request did not offer dropped, the same split the chat
route makes of the same reply, 400s naming the field for what they refuse, the API key, and
no model needed (the app is driven without its lifespan: nothing is loaded)."""

from __future__ import annotations

from typing import Any, get_args

import pytest
from starlette.testclient import TestClient

from pyserve.config import ServerArgs
from pyserve.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from pyserve.parsers.registry import REASONING_STARTS_INSIDE, TOOL_CALL_FACTORIES
from pyserve.server.app import create_app
from pyserve.server.openai.chat_reply import ReplyPlan, parse_reply
from pyserve.server.parse_routes import MAX_CALL_TEXT_CHARS, ReasoningParserName, ToolCallParserName

TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(ServerArgs()))  # (no lifespan: no model is loaded)


def error(param: str | None, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


def test_the_parser_names_are_the_registrys():
    assert get_args(ReasoningParserName) == REASONING_PARSERS
    assert set(get_args(ReasoningParserName)) == set(REASONING_STARTS_INSIDE)
    assert get_args(ToolCallParserName) == TOOL_CALL_PARSERS
    assert set(get_args(ToolCallParserName)) == set(TOOL_CALL_FACTORIES)


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        ("deepseek-r1", "<think>\nI add 1 and 3.\n</think>\n\nThe answer is 4.", "I add 1 and 3.", "The answer is 4."),
        ("deepseek-r1", "No opening tag.</think>Yes", "No opening tag.", "Yes"),
        ("deepseek-r1", "Never closed </thi", "Never closed </thi", ""),
        ("qwen3", "<think>Hm.</think> Sure.", "Hm.", "Sure."),
        ("qwen3", "A plain answer.</think>", "", "A plain answer.</think>"),
        ("qwen3", "", "", ""),
    ],
)
def test_separate_reasoning(client, parser, text, reasoning, content):
    r = client.post("/separate_reasoning", json={"text": text, "reasoning_parser": parser})
    assert r.status_code == 200
    assert r.json() == {"reasoning_text": reasoning, "text": content}


QWEN = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "launch", "arguments": {"target": "moon"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"q": "caf\u00e9"}}\n</tool_call>'
)
PARIS = {"tool_index": 1, "name": "get_weather", "parameters": '{"city": "Paris"}'}


@pytest.mark.parametrize(
    ("parser", "text", "normal_text", "calls"),
    [
        # a call to `launch`, not among the tools, is dropped with its text
        ("qwen25", QWEN, "Let me check.", [PARIS, {"tool_index": 0, "name": "search", "parameters": '{"q": "café"}'}]),
        ("hermes", QWEN, "Let me check.", [PARIS, {"tool_index": 0, "name": "search", "parameters": '{"q": "café"}'}]),
        ("qwen25", "No call here.\n", "No call here.\n", []),
        (
            "llama3",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "search", "parameters": {}}',
            "",
            [PARIS, {"tool_index": 0, "name": "search", "parameters": "{}"}],
        ),
        ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [PARIS]),
        (
            "pythonic",
            '[get_weather(city="Paris"), search()]',
            "",
            [PARIS, {"tool_index": 0, "name": "search", "parameters": "{}"}],
        ),
    ],
)
def test_parse_function_call(client, parser, text, normal_text, calls):
    r = client.post("/parse_function_call", json={"text": text, "tool_call_parser": parser, "tools": TOOLS})
    assert r.status_code == 200
    assert r.json() == {"normal_text": normal_text, "calls": calls}


def test_the_chat_route_reads_the_same_reply_alike(client):
    names = frozenset(t["function"]["name"] for t in TOOLS)
    message, made = parse_reply(ReplyPlan(None, "qwen25", tool_names=names), QWEN)
    assert made
    got = client.post("/parse_function_call", json={"text": QWEN, "tool_call_parser": "qwen25", "tools": TOOLS}).json()
    assert got["normal_text"] == message["content"]
    assert [(c["name"], c["parameters"]) for c in got["calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]
    text = "<think>\nLook it up.\n</think>\n\nIt is sunny."
    message, _ = parse_reply(ReplyPlan("deepseek-r1", None), text)
    got = client.post("/separate_reasoning", json={"text": text, "reasoning_parser": "deepseek-r1"}).json()
    assert (got["reasoning_text"], got["text"]) == (message["reasoning_content"], message["content"])


REASONING_OK = {"text": "a", "reasoning_parser": "qwen3"}
CALL_OK = {"text": "a", "tool_call_parser": "qwen25", "tools": TOOLS}


@pytest.mark.parametrize(
    ("path", "body", "want"),
    [
        ("/separate_reasoning", {"reasoning_parser": "qwen3"}, error("text", "text: Field required")),
        ("/separate_reasoning", {"text": "a"}, error("reasoning_parser", "reasoning_parser: Field required")),
        (
            "/separate_reasoning",
            {"text": "a", "reasoning_parser": "gpt-oss"},
            error("reasoning_parser", "reasoning_parser: Input should be 'deepseek-r1' or 'qwen3'"),
        ),
        (
            "/separate_reasoning",
            {"text": ["a"], "reasoning_parser": "qwen3"},
            error("text", "text: Input should be a valid string"),
        ),
        (
            "/separate_reasoning",
            {**REASONING_OK, "return_blocks": True},
            error("return_blocks", "Unrecognized request argument supplied: return_blocks"),
        ),
        ("/parse_function_call", {"tool_call_parser": "qwen25", "tools": TOOLS}, error("text", "text: Field required")),
        (
            "/parse_function_call",
            {"text": "a", "tools": TOOLS},
            error("tool_call_parser", "tool_call_parser: Field required"),
        ),
        (
            "/parse_function_call",
            {**CALL_OK, "tool_call_parser": "kimi_k2"},
            error(
                "tool_call_parser",
                "tool_call_parser: Input should be 'qwen25', 'qwen', 'hermes', 'llama3', 'mistral' or 'pythonic'",
            ),
        ),
        (
            "/parse_function_call",
            {**CALL_OK, "text": "[" * (MAX_CALL_TEXT_CHARS + 1)},
            error("text", "text: String should have at most 262144 characters"),
        ),
        ("/parse_function_call", {"text": "a", "tool_call_parser": "qwen25"}, error("tools", "tools: Field required")),
        (
            "/parse_function_call",
            {**CALL_OK, "tools": []},
            error("tools", "tools: List should have at least 1 item after validation, not 0"),
        ),
        (
            "/parse_function_call",
            {**CALL_OK, "tools": [{"type": "function", "function": {"description": "no name"}}]},
            error("tools.0.function.name", "tools.0.function.name: Field required"),
        ),
        (
            "/parse_function_call",
            {**CALL_OK, "tools": [{"type": "code", "function": {"name": "f"}}]},
            error("tools.0.type", "tools.0.type: Input should be 'function'"),
        ),
        (
            "/parse_function_call",
            {**CALL_OK, "tools": [TOOLS[0], TOOLS[0]]},
            error("tools", "tools: each function needs a name of its own"),
        ),
    ],
)
def test_refusals_name_the_field(client, path, body, want):
    r = client.post(path, json=body)
    assert r.status_code == 400
    assert r.json() == want


def test_a_body_that_is_not_json_is_a_400(client):
    r = client.post("/parse_function_call", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] is None
    assert r.json()["error"]["message"].startswith("the request body is not valid JSON")


def test_behind_the_api_key():
    client = TestClient(create_app(ServerArgs(api_key="k")))
    for path, body in (("/separate_reasoning", REASONING_OK), ("/parse_function_call", CALL_OK)):
        r = client.post(path, json=body)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = client.post(path, json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
    assert r.json() == {"normal_text": "a", "calls": []}
