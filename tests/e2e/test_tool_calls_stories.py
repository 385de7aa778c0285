"""Tool calls and structured chat replies end to end, on real servers with stories260k.

stories260k knows nothing of tools: its random replies are what a forced call's grammar must
turn into calls that always parse. Left to itself inside the calls' array it keeps adding
calls (it prefers `,` to `]`), so the tests that want whole replies bound the array (a named
function, or `parallel_tool_calls: false`: one call) or push `]` up with a logit bias; these
servers write compact JSON (`--constrained-json-disable-any-whitespace`), which keeps replies
short; the default whitespace bound is tested in test_structured_stories.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.conftest import stories_chat_server

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "stories_tools_chat_template.jinja"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
RIGHT_BRACKET = "509"  # stories260k's token "]"
NO_WHITESPACE = "--constrained-json-disable-any-whitespace"


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory, stories_path):
    yield from stories_chat_server(
        tmp_path_factory,
        stories_path,
        "tools",
        8192,
        ["--chat-template", str(TEMPLATE), "--tool-call-parser", "qwen25", NO_WHITESPACE],
    )


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory, stories_path):
    yield from stories_chat_server(
        tmp_path_factory,
        stories_path,
        "qwen3",
        4096,
        ["--chat-template", str(TEMPLATE), "--reasoning-parser", "qwen3", NO_WHITESPACE],
    )


async def _chat(client: httpx.AsyncClient, body: dict) -> dict:
    """The reply of a chat request as a non-streamed body; a streamed one is assembled from
    its deltas (checking each tool-call delta's shape)."""
    if not body.get("stream"):
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()
    content = reasoning = ""
    calls: list[dict] = []
    reason = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (choice,) = json.loads(line[6:])["choices"]
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls", ()):
                if "id" in call:  # a call's first delta: index, id, type, name, empty arguments
                    assert call["index"] == len(calls) and call["function"]["arguments"] == ""
                    calls.append({"id": call["id"], "type": call["type"], "function": dict(call["function"])})
                else:  # later ones: argument text only
                    assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                    calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            reason = choice["finish_reason"] or reason
    message: dict = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return {"choices": [{"message": message, "finish_reason": reason}]}


def run_all(server, bodies: list[dict]) -> list[dict]:
    async def go() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            return await asyncio.gather(*(_chat(client, b) for b in bodies))

    return asyncio.run(go())


def calls_of(reply: dict) -> list[tuple[str, str]]:
    return [
        (c["function"]["name"], c["function"]["arguments"])
        for c in reply["choices"][0]["message"].get("tool_calls", [])
    ]


def check_calls(reply: dict, allowed: set[str]) -> list[tuple[str, dict]]:
    """The reply's calls, each checked: a known name, JSON arguments valid for its tool."""
    choice = reply["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert message["content"] is None and message["tool_calls"], message
    out = []
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
        name = call["function"]["name"]
        assert name in allowed, name
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, PARAMS[name])
        out.append((name, args))
    return out


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_of_50_seeded_requests_always_parse(tools_server, choice):
    allowed = {"get_time"} if choice == "named" else set(PARAMS)
    base = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": NAMED if choice == "named" else "required",
        # one call: a named function's grammar says so itself, required is told
        **({} if choice == "named" else {"parallel_tool_calls": False}),
        "temperature": 1.0,
        "max_tokens": 200,
    }
    plain = run_all(tools_server, [{**base, "seed": s} for s in range(50)])
    streamed = run_all(tools_server, [{**base, "seed": s, "stream": True} for s in range(50)])
    names = set()
    for p, s in zip(plain, streamed):
        (call,) = check_calls(p, allowed)
        names.add(call[0])
        assert calls_of(s) == calls_of(p)  # the same seed: the same call, streamed or not
    assert names == allowed  # (the seeds reach every allowed tool)


def test_two_calls_in_one_reply_arrive_whole_at_stream_interval_16(tools_server):
    base = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 1.0,
        "max_tokens": 300,
        "logit_bias": {RIGHT_BRACKET: 20},  # end the array after a few calls
    }
    plain = run_all(tools_server, [{**base, "seed": s} for s in range(50)])
    two = [s for s, p in enumerate(plain) if p["choices"][0]["finish_reason"] == "tool_calls" and len(calls_of(p)) == 2]
    assert two, [len(calls_of(p)) for p in plain]
    seed = two[0]
    (streamed,) = run_all(tools_server, [{**base, "seed": seed, "stream": True, "stream_interval": 16}])
    assert len(check_calls(streamed, set(PARAMS))) == 2
    assert calls_of(streamed) == calls_of(plain[seed])
    # finish_reason is tool_calls exactly when calls were made (a length finish stays length)
    for p in plain:
        choice = p["choices"][0]
        if choice["finish_reason"] == "length":
            continue
        assert choice["finish_reason"] == ("tool_calls" if calls_of(p) else "stop")
        check_calls(p, set(PARAMS))


def test_forced_calls_cut_by_max_tokens_leave_no_content(tools_server):
    """max_tokens that end the array early: finish_reason length, no content (the array's
    text is not an answer), the calls whose name was complete, streamed as not."""
    base = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    bodies = [{**base, "max_tokens": n} for n in (1, 4, 8, 16, 32, 48)]
    plain = run_all(tools_server, bodies)
    streamed = run_all(tools_server, [{**b, "stream": True} for b in bodies])
    cut = []
    for p, s in zip(plain, streamed):
        assert calls_of(s) == calls_of(p)
        for reply in (p, s):
            choice = reply["choices"][0]
            assert choice["message"]["content"] is None, choice
        if p["choices"][0]["finish_reason"] == "length":
            assert s["choices"][0]["finish_reason"] == "length"
            cut.append(len(calls_of(p)))
    assert cut[0] == 0 and max(cut) >= 1, cut  # cut before a call's name, and inside a call


def test_auto_without_calls_keeps_the_text_as_content(tools_server):
    """stories260k writes no <tool_call>: the reply is the model's text, every character, as
    completions give it for the templated prompt, with its finish_reason and no tool_calls."""
    body = {"messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 24}
    (reply,) = run_all(tools_server, [body])
    prompt = "Tools: get_weather, get_time\nUser: What is the weather in Paris?\nAssistant:"
    native = httpx.post(
        tools_server.base_url + "/v1/completions",
        json={"prompt": prompt, "add_special_tokens": False, "temperature": 0, "max_tokens": 24},
        timeout=60,
    ).json()
    choice = reply["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": native["choices"][0]["text"]}
    assert choice["finish_reason"] == native["choices"][0]["finish_reason"]
    assert reply["usage"] == native["usage"]
    (streamed,) = run_all(tools_server, [{**body, "stream": True}])
    assert streamed["choices"][0] == {"message": choice["message"], "finish_reason": choice["finish_reason"]}


def test_tool_messages_go_through_the_template(tools_server, stories_path):
    from transformers import AutoTokenizer

    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = httpx.post(
        tools_server.base_url + "/v1/chat/completions",
        json={"messages": messages, "tools": TOOLS, "max_tokens": 1, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    prompt = (
        "Tools: get_weather, get_time\nUser: What is the weather in Paris?\n"
        'Assistant: <call>{"name": "get_weather", "arguments": {"city": "Paris"}}</call>\n'
        "Tool call_1: sunny\nAssistant:"
    )
    tok = AutoTokenizer.from_pretrained(stories_path)
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(prompt, add_special_tokens=False))


def test_invalid_schemas_are_refused_by_their_field(tools_server):
    bad_tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 5, "maximum": 1}}}
    ]
    bad_rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    for stream in (False, True):
        for route, body, param, reason in (
            (
                "/v1/chat/completions",
                {"messages": MESSAGES, "tools": bad_tools, "tool_choice": "required"},
                "tools",
                "minimum greater than maximum",
            ),
            (
                "/v1/chat/completions",
                {"messages": MESSAGES, "response_format": bad_rf},
                "response_format",
                'Unsupported type "foo"',
            ),
            ("/v1/completions", {"prompt": "Hi", "guided_regex": "(("}, "guided_regex", "not closed"),
        ):
            r = httpx.post(tools_server.base_url + route, json={**body, "stream": stream, "max_tokens": 8}, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and reason in err["message"] and err["message"].startswith(param + ":"), err


def test_response_format_on_completions(tools_server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    for seed in range(5):
        r = httpx.post(
            tools_server.base_url + "/v1/completions",
            json={
                "prompt": "Once upon a time",
                "max_tokens": 60,
                "seed": seed,
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
            },
            timeout=60,
        )
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), schema)


def test_response_format_with_a_reasoning_parser_puts_json_in_content(qwen3_server):
    """With --reasoning-parser qwen3 and the thinking off (the template opens and closes an empty
    thinking block), the grammar holds from the reply's start: valid JSON in content, no
    reasoning, streamed or not."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["Lily", "Tom"]},
            "age": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["name", "age"],
    }
    base = {
        "messages": MESSAGES,
        "temperature": 1.0,
        "max_tokens": 100,
        "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}},
    }
    plain = run_all(qwen3_server, [{**base, "seed": s} for s in range(10)])
    streamed = run_all(qwen3_server, [{**base, "seed": s, "stream": True} for s in range(10)])
    for p, s in zip(plain, streamed):
        choice = p["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        message = choice["message"]
        assert message["reasoning_content"] is None and "tool_calls" not in message
        jsonschema.validate(json.loads(message["content"]), schema)
        assert s["choices"][0]["message"] == {"role": "assistant", "content": message["content"]}
