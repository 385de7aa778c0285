"""SGLang's text-only parse routes, `/separate_reasoning` and `/parse_function_call`: a text the
client sends (a reply it got elsewhere, or a `/generate` output) goes through the server's own
reasoning and tool-call parsers (pyserve/parsers, the ones the chat route runs), so a client of
the native API gets the split the chat route would make. No model is involved: both answer
while the model loads.

The reasoning split is one pass over the text, on the loop. The tool-call parsers take time
growing with the square of the length on some texts (each consumed piece re-slices their
buffer: 200,000 `[` take the pythonic parser about 4 s), which a model's reply of bounded
length never costs but a client's text could: `/parse_function_call` takes at most
MAX_CALL_TEXT_CHARS characters and parses in a worker thread (`asyncio.to_thread`), so the
loop serves on meanwhile.

Request and response shapes are SGLang's (its io_struct `SeparateReasoningReqInput` and
`ParseFunctionCallReq`, its http_server's answers). Unlike SGLang, `tool_call_parser` and `tools`
are required: without a parser nothing can be read, and without tools every call would be
dropped (a call to a function the request did not offer is dropped, as SGLang and the chat
route do), so either is a 400 naming the field instead of a 200 that is always empty.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.parsers.registry import make_reasoning_parser, make_tool_call_parser
from pyserve.parsers.tool_call_base import parse_all
from pyserve.server.openai.protocol import STRICT
from pyserve.server.openai.tools import Tool, check_tools
from pyserve.server.render import SafeJSONResponse
from pyserve.server.request_body import parse_json

# The parser names pyserve/parsers/__init__.py lists (SGLang's), as types so that the
# OpenAPI document lists them and an unknown name is a 400 naming the field
# (tests/unit/test_parse_routes.py checks they are the same).
ReasoningParserName = Literal["deepseek-r1", "qwen3"]
ToolCallParserName = Literal["qwen25", "qwen", "hermes", "llama3", "mistral", "pythonic"]

# The longest text /parse_function_call reads: a reply of about 64K tokens at about four
# characters a token (see the module docstring for why there is a bound).
MAX_CALL_TEXT_CHARS = 1 << 18


class SeparateReasoningRequest(BaseModel):
    """SGLang's `SeparateReasoningReqInput`: `text`, a whole reply, split by the
    `--reasoning-parser` format `reasoning_parser`."""

    model_config = STRICT
    text: str
    reasoning_parser: ReasoningParserName


class ParseFunctionCallRequest(BaseModel):
    """SGLang's `ParseFunctionCallReq`: `text`, a whole reply, read in the `--tool-call-parser`
    format `tool_call_parser` (at most MAX_CALL_TEXT_CHARS characters); `tools` the
    functions it may call (the chat route's shape, names unique)."""

    model_config = STRICT
    text: str = Field(max_length=MAX_CALL_TEXT_CHARS)
    tool_call_parser: ToolCallParserName
    tools: list[Tool] = Field(min_length=1)


def separate_reasoning_text(text: str, parser: str) -> tuple[str, str]:
    """(reasoning, content) of a whole reply `text` split by the reasoning parser `parser`
    (a name of parsers.REASONING_PARSERS; KeyError for another), as the chat route splits a
    non-streamed reply."""
    split = make_reasoning_parser(parser)
    reasoning, content = split.feed(text)
    more_reasoning, more_content = split.finish()
    return reasoning + more_reasoning, content + more_content


def parse_function_calls(text: str, parser: str, tools: list[Tool]) -> tuple[str, list[dict[str, Any]]]:
    """(normal text, calls) of a whole reply `text` read by the tool-call parser `parser` (a
    name of parsers.TOOL_CALL_PARSERS; KeyError for another). Each call is SGLang's
    `ToolCallItem`: `{"tool_index": the called function's index in tools, "name",
    "parameters": its arguments' JSON text as the model wrote it}`; calls to a function not in
    `tools` are dropped, their text too (as the chat route drops them). Any thread (a fresh
    parser per call)."""
    reply = parse_all(make_tool_call_parser(parser), text)
    index = {tool.function.name: i for i, tool in enumerate(tools)}
    calls = [
        {"tool_index": index[call.name], "name": call.name, "parameters": call.arguments}
        for call in reply.calls
        if call.name in index
    ]
    return reply.content, calls


async def separate_reasoning(request: Request) -> Response:
    """POST /separate_reasoning {"text", "reasoning_parser"} (SGLang's): the text's thinking
    apart from its answer, as the chat route splits a reply → {"reasoning_text", "text"}.
    Needs no model."""
    body = SeparateReasoningRequest.model_validate(await parse_json(request))
    reasoning, content = separate_reasoning_text(body.text, body.reasoning_parser)
    return SafeJSONResponse({"reasoning_text": reasoning, "text": content})


async def parse_function_call(request: Request) -> Response:
    """POST /parse_function_call {"text", "tool_call_parser", "tools"} (SGLang's): the calls in
    the text, as the chat route reads a reply → {"normal_text", "calls": [{"tool_index",
    "name", "parameters"}]}. Needs no model; parses in a worker thread."""
    body = ParseFunctionCallRequest.model_validate(await parse_json(request))
    check_tools(body.tools, None)
    normal_text, calls = await asyncio.to_thread(parse_function_calls, body.text, body.tool_call_parser, body.tools)
    return SafeJSONResponse({"normal_text": normal_text, "calls": calls})


ROUTES = [
    Route("/separate_reasoning", separate_reasoning, methods=["POST"]),
    Route("/parse_function_call", parse_function_call, methods=["POST"]),
]
