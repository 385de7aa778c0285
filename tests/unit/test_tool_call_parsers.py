"""Tool-call parsers (pyserve/parsers): each format's canned model text parsed exactly, and the
same result whatever the pieces the text arrives in (1, 3 and 7 characters, and whole)."""

from __future__ import annotations

import pytest

from pyserve.parsers import TOOL_CALL_PARSERS
from pyserve.parsers.registry import TOOL_CALL_FACTORIES, make_forced_call_parser, make_tool_call_parser
from pyserve.parsers.tool_call_base import (
    CallArgs,
    CallStart,
    ParsedCall,
    ParsedReply,
    TextPiece,
    ToolCallParser,
    collect,
    held_marker_len,
    parse_all,
)

CHUNKS = (1, 3, 7, 10**9)


def chunked(parser: ToolCallParser, text: str, size: int) -> ParsedReply:
    reply = ParsedReply("")
    for k in range(0, len(text), size):
        collect(parser.feed(text[k : k + size]), reply)
    return collect(parser.finish(), reply)


def check(make, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    want = ParsedReply(content, [ParsedCall(n, a) for n, a in calls])
    assert parse_all(make(), text) == want
    for size in CHUNKS:
        assert chunked(make(), text, size) == want, size


def qwen():
    return make_tool_call_parser("qwen25")


CASES = {
    "qwen25": [
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris", "days": [1, {"x": "}\\""}]}}'
            '\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>',
            "Let me check.",
            [("get_weather", '{"city": "Paris", "days": [1, {"x": "}\\""}]}'), ("now", "{}")],
        ),
        # parameters for arguments, a JSON string of the arguments, no arguments at all
        (
            '<tool_call>{"name": "a", "parameters": {"q": 1}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": "{\\"k\\": \\"v\\"}"}</tool_call>'
            '<tool_call>{"name": "c"}</tool_call>',
            "",
            [("a", '{"q": 1}'), ("b", '{"k": "v"}'), ("c", "{}")],
        ),
        # content between and after calls keeps its inner whitespace; the text around the calls goes
        (
            'A <tool_call>\n{"name": "f", "arguments": {"x": "<tool_call>"}}\n</tool_call>\n\nB  <tool_c',
            "A\n\nB  <tool_c",
            [("f", '{"x": "<tool_call>"}')],
        ),
        # a block that is not a call stays in the content as written
        ('Hi <tool_call>{"x": 1}</tool_call> there', 'Hi <tool_call>{"x": 1}</tool_call> there', []),
        ("Hi <tool_call>not json</tool_call>", "Hi <tool_call>not json</tool_call>", []),
        # cut short (a length finish): the call keeps what had come
        ('<tool_call>\n{"name": "f", "arguments": {"city": "Par', "", [("f", '{"city": "Par')]),
        ('So <tool_call>\n{"nam', 'So <tool_call>\n{"nam', []),
    ],
    "llama3": [
        (
            '<|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", "arguments": {"n": -1.5e3}}',
            "",
            [("a", '{"q": "x;y"}'), ("b", '{"n": -1.5e3}')],
        ),
        ('  {"name": "get_time", "parameters": {}}', "", [("get_time", "{}")]),
        ('Sure.<|python_tag|>{"name": "f", "parameters": {"a": null}}', "Sure.", [("f", '{"a": null}')]),
        # JSON that names no function is content, and so is plain text
        ('{"answer": 42}', '{"answer": 42}', []),
        ("  The answer is 42.\n", "  The answer is 42.\n", []),
        ("<|python", "<|python", []),
    ],
    "mistral": [
        (
            'Sure [TOOL_CALLS] [{"name": "a", "arguments": {"q": 1}}, {"name": "b", "arguments": {"r": [2]}}] done',
            "Sure done",
            [("a", '{"q": 1}'), ("b", '{"r": [2]}')],
        ),
        ('[TOOL_CALLS]{"name": "only", "arguments": {"z": "]"}}', "", [("only", '{"z": "]"}')]),
        ("No calls [TOOL_CALL", "No calls [TOOL_CALL", []),
    ],
    "pythonic": [
        (
            'Calling [get_weather(city="Paris", days=3), ns.get_time()] ok',
            "Calling ok",
            [("get_weather", '{"city": "Paris", "days": 3}'), ("ns.get_time", "{}")],
        ),
        (
            "[f(a=[1, (2, 3)], b={'k': None}, c='x)]', d=True)]",
            "",
            [("f", '{"a": [1, [2, 3]], "b": {"k": null}, "c": "x)]", "d": true}')],
        ),
        # lists that are not calls (or calls that are not literal) stay content
        ("[note] and [1, 2] and [f(x)] and [g(a=b)]", "[note] and [1, 2] and [f(x)] and [g(a=b)]", []),
        ("cut [f(a=1", "cut [f(a=1", []),
    ],
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_format_parses_exactly_in_every_chunking(name):
    for text, content, calls in CASES[name]:
        check(lambda: make_tool_call_parser(name), text, content, calls)


def test_aliases_and_names():
    assert set(TOOL_CALL_FACTORIES) == set(TOOL_CALL_PARSERS)
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for alias in ("hermes", "qwen"):
        assert parse_all(make_tool_call_parser(alias), text) == parse_all(qwen(), text)
    with pytest.raises(KeyError):
        make_tool_call_parser("nope")


def test_forced_array_format():
    make = make_forced_call_parser
    text = '[{"name": "f", "parameters": {"a": 1, "s": "[{,}]"}}, {"name": "g", "parameters": {}}]'
    check(make, text, "", [("f", '{"a": 1, "s": "[{,}]"}'), ("g", "{}")])
    check(make, ' \n[ {"name":"f","parameters":{}} ]', "", [("f", "{}")])
    check(make, "plain text", "plain text", [])
    check(make, '[{"name": "f", "parameters": {"a": [1, 2', "", [("f", '{"a": [1, 2')])


def test_events_of_a_streamed_call_come_in_order():
    parser = qwen()
    events = []
    for piece in ["Hi", " <tool_", 'call>{"arguments": {"a"', ': 1}, "name": "f"}', "</tool_call>"]:
        events += parser.feed(piece)
    events += parser.finish()
    # arguments read before the name wait for it; the call starts, then its arguments
    assert events == [TextPiece("Hi"), CallStart(0, "f"), CallArgs(0, '{"a": 1}')]


def test_arguments_stream_as_they_come():
    parser = make_tool_call_parser("llama3")
    assert parser.feed('{"name": "f", "parameters": {"city": "Pa') == [CallStart(0, "f"), CallArgs(0, '{"city": "Pa')]
    assert parser.feed('ris"}') == [CallArgs(0, 'ris"}')]
    assert parser.finish() == []


def test_held_marker_len():
    assert held_marker_len("abc<tool", "<tool_call>") == 5
    assert held_marker_len("abc<", "<tool_call>") == 1
    assert held_marker_len("abc", "<tool_call>") == 0
    assert held_marker_len("<tool_call>", "<tool_call>") == 0  # whole: found, not held
