"""Property tests (hypothesis, derandomized, bounded) of the reply parsers and the OpenAI
tool/structured-output request path:

* any text (built from the formats' own markers and JSON pieces) gives the same events
  whatever the pieces it arrives in, and no parser raises;
* any mutation of a chat body's tools, tool_choice, response_format, guided_* fields and tool
  messages is either refused (a pydantic ValidationError or InvalidRequestError: a 400) or
  prepared (plan, grammar, template messages) without any other exception."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pyserve.errors import InvalidRequestError
from pyserve.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from pyserve.parsers.registry import make_forced_call_parser, make_reasoning_parser, make_tool_call_parser
from pyserve.parsers.tool_call_base import ParsedReply, collect, parse_all
from pyserve.server.openai.chat_reply import reply_plan
from pyserve.server.openai.protocol import ChatCompletionRequest

SETTINGS = settings(
    derandomize=True, max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "<think>",
    "</think>",
    '{"name": "f", "arguments": ',
    '{"name": "g", "parameters": {"a": [1, "x]"]}}',
    '"name"',
    '"arguments"',
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    '"',
    "\\",
    ",",
    ";",
    ":",
    " ",
    "\n",
    "f(a=1)",
    "g(b='y')",
    "null",
    "12",
    "text",
    "é",
]
texts = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)


def chunked(parser: Any, text: str, sizes: list[int]) -> ParsedReply:
    reply, at, k = ParsedReply(""), 0, 0
    while at < len(text):
        size = sizes[k % len(sizes)]
        collect(parser.feed(text[at : at + size]), reply)
        at, k = at + size, k + 1
    return collect(parser.finish(), reply)


@SETTINGS
@given(texts, st.lists(st.integers(1, 9), min_size=1, max_size=5))
def test_tool_parsers_agree_in_any_chunking(text, sizes):
    makers = [lambda name=name: make_tool_call_parser(name) for name in TOOL_CALL_PARSERS]
    for make in [*makers, make_forced_call_parser]:
        one = parse_all(make(), text)
        assert chunked(make(), text, sizes) == one
        if not one.calls:  # a reply without calls keeps every character
            assert one.content == text


@SETTINGS
@given(texts, st.lists(st.integers(1, 9), min_size=1, max_size=5))
def test_reasoning_parsers_agree_in_any_chunking(text, sizes):
    for name in REASONING_PARSERS:
        parser = make_reasoning_parser(name)
        whole = tuple("".join(p) for p in zip(parser.feed(text), parser.finish()))
        parser = make_reasoning_parser(name)
        parts, at, k = [], 0, 0
        while at < len(text):
            parts.append(parser.feed(text[at : at + sizes[k % len(sizes)]]))
            at, k = at + sizes[k % len(sizes)], k + 1
        parts.append(parser.finish())
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == whole


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
BASE: dict[str, Any] = {
    "messages": [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ],
    "tools": [TOOL],
    "tool_choice": "required",
    "response_format": {"type": "text"},
}
PATHS = [
    ("tools",),
    ("tools", 0),
    ("tools", 0, "function"),
    ("tools", 0, "function", "name"),
    ("tools", 0, "function", "parameters"),
    ("tools", 0, "function", "parameters", "$defs"),
    ("tool_choice",),
    ("parallel_tool_calls",),
    ("response_format",),
    ("response_format", "type"),
    ("response_format", "json_schema"),
    ("guided_json",),
    ("guided_choice",),
    ("regex",),
    ("json_schema",),
    ("structural_tag",),
    ("messages", 1, "tool_calls"),
    ("messages", 1, "tool_calls", 0, "function", "arguments"),
    ("messages", 2, "tool_call_id"),
    ("chat_template_kwargs",),
    ("separate_reasoning",),
]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.text(max_size=5)
    | st.sampled_from(["json_schema", "required", "auto", "function", "f"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["type", "name", "schema", "function", "$defs", "$ref", "x"]), inner, max_size=3
        )
    ),
    max_leaves=8,
)


def _set(body: dict, path: tuple, value: Any) -> None:
    node: Any = body
    for key in path[:-1]:
        if isinstance(node, dict) and isinstance(key, str):
            node = node.setdefault(key, {})
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return
    if isinstance(node, dict) and isinstance(path[-1], str):
        node[path[-1]] = value
    elif isinstance(node, list) and isinstance(path[-1], int) and path[-1] < len(node):
        node[path[-1]] = value


@SETTINGS
@given(
    st.lists(st.tuples(st.sampled_from(PATHS), json_values), min_size=1, max_size=4), st.sampled_from([None, "qwen25"])
)
def test_mutated_tool_bodies_are_refused_or_prepared(mutations, parser):
    body = copy.deepcopy(BASE)
    for path, value in mutations:
        _set(body, path, value)
    try:
        request = ChatCompletionRequest.model_validate(body)
        request.check_supported()
        reply_plan(request, parser, "qwen3")
        request.constraint()
        [m.to_template() for m in request.messages]
        request.template_kwargs()
    except (ValidationError, InvalidRequestError):
        pass
