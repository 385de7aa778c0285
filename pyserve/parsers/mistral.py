"""Mistral's tool-call format (`--tool-call-parser mistral`): a `[TOOL_CALLS]` marker, then a
JSON array of calls, as Mistral 7B Instruct v0.3 and Mistral Nemo write them:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

Text before the marker (and after the array) is content. `[TOOL_CALLS]` is a special token:
the routes keep special tokens in the text of requests with tools parsed this way.
"""

from __future__ import annotations

from pyserve.parsers.json_array import JsonArrayParser

MARKER = "[TOOL_CALLS]"


class MistralParser(JsonArrayParser):
    """`[TOOL_CALLS] [{...}, ...]` (see the module docstring). One per reply; loop thread."""

    def __init__(self) -> None:
        super().__init__(marker=MARKER)
