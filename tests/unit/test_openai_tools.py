"""Tools on the chat route (pyserve/server/openai/tools.py, chat_reply.py's plan): the grammar of
a forced call, the checks of tools and tool_choice, which parsers a request's reply goes
through, and tool messages through a chat template in transformers' convention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr

from pyserve.constrained import ThinkBlock
from pyserve.errors import InvalidRequestError
from pyserve.server.openai.chat_reply import (
    FORCED,
    ReplyPlan,
    grammar_think,
    keeps_special_tokens,
    reply_plan,
    thinking_constraint,
)
from pyserve.server.openai.protocol import ChatCompletionRequest
from pyserve.server.openai.structured import Constraint
from pyserve.server.openai.tools import Tool, forced_calls_schema, new_call_id

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "stories_tools_chat_template.jinja"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]


def chat(**fields) -> ChatCompletionRequest:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
    body.check_supported()
    return body


def accepts(schema: str, text: str) -> bool:
    return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_json_schema(schema), text)


def test_forced_schema_of_required_and_of_a_named_function():
    no_params = {"type": "object", "properties": {}}

    def item(name, params):
        return {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }

    body = chat(tools=TOOLS, tool_choice="required")
    c = body.constraint()
    assert c is not None and (c.kind, c.param) == ("json_schema", "tools")
    assert json.loads(c.text) == {
        "type": "array",
        "items": {"anyOf": [item("get_weather", WEATHER), item("now", no_params)]},
        "minItems": 1,
    }
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})  # one call
    c = named.constraint()
    assert c is not None
    assert json.loads(c.text) == {"type": "array", "items": item("now", no_params), "minItems": 1, "maxItems": 1}
    one = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).constraint()
    assert one is not None and json.loads(one.text)["maxItems"] == 1
    assert body.sampling_params(32, body.constraint()).json_schema == body.constraint().text  # type: ignore[union-attr]
    for mode in ("auto", "none", None):
        assert chat(tools=TOOLS, tool_choice=mode).constraint() is None


def test_forced_schema_accepts_exactly_calls_of_the_tools():
    schema = chat(tools=TOOLS, tool_choice="required").constraint().text  # type: ignore[union-attr]
    good = '[{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}, {"name": "now", "parameters": {}}]'
    assert accepts(schema, good)
    for bad in (
        "[]",
        '[{"name": "get_time", "parameters": {}}]',
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
        '[{"name": "now", "parameters": {"x": 1}}]',
        '{"name": "now", "parameters": {}}',
    ):
        assert not accepts(schema, bad), bad


def test_definitions_move_to_the_root():
    item_def = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"]}
    other = {"type": "string"}
    tools = [
        Tool.model_validate(
            {"type": "function", "function": {"name": "a", "parameters": {**params, "$defs": {"Item": item_def}}}}
        ),
        Tool.model_validate(
            {"type": "function", "function": {"name": "b", "parameters": {**params, "$defs": {"Item": other}}}}
        ),
    ]
    schema = json.loads(forced_calls_schema(tools, None))
    assert schema["$defs"] == {"Item": item_def, "b.Item": other}
    a, b = schema["items"]["anyOf"]
    assert a["properties"]["parameters"] == params
    assert b["properties"]["parameters"]["properties"]["item"] == {"$ref": "#/$defs/b.Item"}
    text = json.dumps(schema)
    assert accepts(
        text, '[{"name": "a", "parameters": {"item": {"n": 1}}}, {"name": "b", "parameters": {"item": "x"}}]'
    )
    assert not accepts(text, '[{"name": "a", "parameters": {"item": "x"}}]')


def test_tool_choice_checks():
    def refused(param, **fields):
        with pytest.raises(InvalidRequestError) as info:
            chat(**fields)
        assert info.value.param == param
        return info.value.message

    assert refused("tool_choice", tool_choice="required") == "tool_choice 'required' needs tools"
    refused("tool_choice", tool_choice={"type": "function", "function": {"name": "now"}})
    assert "not among the tools" in refused(
        "tool_choice", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "later"}}
    )
    refused("tools", tools=TOOLS + TOOLS[:1])
    chat(tool_choice="auto")  # without tools: nothing to do, accepted as before
    chat(tool_choice="none")


def test_reply_plan():
    assert reply_plan(chat(), None, None) is None
    assert reply_plan(chat(tools=TOOLS, tool_choice="none"), "qwen25", None) is None
    names = frozenset({"get_weather", "now"})
    assert {t["function"]["name"] for t in TOOLS} == names
    assert reply_plan(chat(tools=TOOLS), "qwen25", None) == ReplyPlan(None, "qwen25", tool_names=names)
    assert reply_plan(chat(tools=TOOLS, tool_choice="required"), None, None) == ReplyPlan(
        None, FORCED, tool_names=names
    )
    assert reply_plan(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None, None) == ReplyPlan(
        None, FORCED, max_calls=1, tool_names=names
    )
    with pytest.raises(InvalidRequestError) as info:
        reply_plan(chat(tools=TOOLS), None, "qwen3")
    assert info.value.param == "tools" and "--tool-call-parser" in info.value.message
    # reasoning: split unless separate_reasoning is false or the thinking is off for a parser
    # whose replies start inside it
    off = {"enable_thinking": False}
    assert reply_plan(chat(), None, "qwen3") == ReplyPlan("qwen3", None)
    assert reply_plan(chat(chat_template_kwargs=off), None, "qwen3") == ReplyPlan("qwen3", None)
    assert reply_plan(chat(chat_template_kwargs=off), None, "deepseek-r1") is None
    assert reply_plan(chat(separate_reasoning=False), None, "deepseek-r1") is None
    assert reply_plan(chat(stream_reasoning=False), None, "deepseek-r1") == ReplyPlan(
        "deepseek-r1", None, stream_reasoning=False
    )


def test_a_grammar_allows_thinking_first_only_when_the_model_thinks():
    body = chat(response_format={"type": "json_object"})
    assert grammar_think(body, "qwen3", True, 100) == ThinkBlock(False, 50, "<think>", "</think>")
    assert grammar_think(body, "deepseek-r1", True, 101) == ThinkBlock(True, 50, "<think>", "</think>")
    assert grammar_think(body, None, True, 100) is None
    assert grammar_think(body, "qwen3", False, 100) is None
    assert grammar_think(chat(chat_template_kwargs={"enable_thinking": False}), "qwen3", True, 100) is None
    # separate_reasoning false only keeps the thinking in the content: the model still thinks first
    assert grammar_think(chat(separate_reasoning=False), "qwen3", True, 8) == ThinkBlock(False, 4)
    assert grammar_think(chat(thinking_budget=7), "qwen3", True, 100) == ThinkBlock(False, 7)


def test_a_thinking_budget_alone_constrains_nothing_but_the_thinking():
    constraint = Constraint("json_schema", "{}", "response_format")
    assert thinking_constraint(chat(thinking_budget=5), "qwen3", constraint) is constraint
    assert thinking_constraint(chat(), "qwen3", None) is None
    assert thinking_constraint(chat(thinking_budget=5), "qwen3", None) == Constraint(
        "regex", r"[\s\S]*", "thinking_budget"
    )
    with pytest.raises(InvalidRequestError) as info:
        thinking_constraint(chat(thinking_budget=5), None, None)
    assert (info.value.param, info.value.message) == (
        "thinking_budget",
        "thinking_budget needs a server started with --reasoning-parser (the model's thinking markers)",
    )


def test_special_token_markers_are_kept_in_the_text():
    body = chat(tools=TOOLS)
    assert keeps_special_tokens(ReplyPlan(None, "llama3"), body) is False
    assert keeps_special_tokens(ReplyPlan(None, "mistral"), body) is False
    assert keeps_special_tokens(ReplyPlan(None, "qwen25"), body) is None
    assert keeps_special_tokens(None, body) is None
    assert keeps_special_tokens(ReplyPlan(None, "llama3"), chat(tools=TOOLS, skip_special_tokens=True)) is None


def test_call_ids():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 29 and i.startswith("call_") and int(i[5:], 16) >= 0 for i in ids)


def test_tool_messages_through_the_chat_template(stories_path):
    from transformers import AutoTokenizer

    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                        },
                        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "not json"}},
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
            ],
            "tools": TOOLS,
        }
    )
    body.check_supported()
    messages = [m.to_template() for m in body.messages]
    assert messages[1]["content"] == ""
    assert messages[1]["tool_calls"][0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
    }
    assert messages[1]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    kwargs = body.template_kwargs()
    assert kwargs["tools"][1] == {"type": "function", "function": {"name": "now"}}
    tok = AutoTokenizer.from_pretrained(stories_path)
    text = tok.apply_chat_template(messages, chat_template=TEMPLATE.read_text(), tokenize=False, **kwargs)
    assert text == (
        "Tools: get_weather, now\n"
        "User: Weather in Paris?\n"
        'Assistant: <call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</call>'
        '<call>{"name": "now", "arguments": "not json"}</call>\n'
        "Tool call_1: sunny\n"
        "Tool call_2: noon\n"
        "Assistant:"
    )
    assert "tools" not in chat(tools=TOOLS, tool_choice="none").template_kwargs()
    assert "tools" not in chat().template_kwargs()


def test_a_malformed_tool_choice_names_the_field_not_a_union_branch():
    from pydantic import ValidationError

    from pyserve.server.errors import validation_message
    from pyserve.server.openai.protocol import ChatCompletionRequest

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "x", "function": {"name": "f"}},
    }
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    assert validation_message(info.value) == (
        "tool_choice: Input should be 'none', 'auto' or 'required'",
        "tool_choice",
    )
