"""Parsers by name: `--tool-call-parser` and `--reasoning-parser` (the names in __init__.py)."""

from __future__ import annotations

from collections.abc import Callable

from pyserve.parsers.json_array import JsonArrayParser
from pyserve.parsers.llama3 import Llama3Parser
from pyserve.parsers.mistral import MistralParser
from pyserve.parsers.pythonic import PythonicParser
from pyserve.parsers.qwen25 import Qwen25Parser
from pyserve.parsers.reasoning_parser import ReasoningParser
from pyserve.parsers.tool_call_base import ToolCallParser

TOOL_CALL_FACTORIES: dict[str, Callable[[], ToolCallParser]] = {
    "qwen25": Qwen25Parser,
    "qwen": Qwen25Parser,
    "hermes": Qwen25Parser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
# the formats whose markers are special tokens, which must stay in the text to be seen
SPECIAL_TOKEN_MARKERS = frozenset({"llama3", "mistral"})
# reasoning parsers: whether the reply starts inside the thinking
REASONING_STARTS_INSIDE = {"deepseek-r1": True, "qwen3": False}


def make_tool_call_parser(name: str) -> ToolCallParser:
    """A fresh parser of the `--tool-call-parser` format `name` (KeyError for another name)."""
    return TOOL_CALL_FACTORIES[name]()


def make_forced_call_parser() -> ToolCallParser:
    """A fresh parser of the JSON array a forced tool call's grammar produces."""
    return JsonArrayParser()


def make_reasoning_parser(name: str) -> ReasoningParser:
    """A fresh parser of the `--reasoning-parser` format `name` (KeyError for another name)."""
    return ReasoningParser(starts_in_reasoning=REASONING_STARTS_INSIDE[name])
