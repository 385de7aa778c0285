"""Tool calling on the chat route: the request's `tools` and `tool_choice`, the grammar that
forces a call, and the tool messages as chat templates read them.

`tool_choice` `required` or a named function is enforced with a grammar, as SGLang does: the
reply must be a JSON array (at least one item) of `{"name": <an allowed tool>, "parameters":
<that tool's parameters>}` objects, which is then parsed as that array (parsers/json_array.py),
never with the model's own format, so it always parses.

Chat templates follow transformers' convention: `tools=` is the list of tool definitions in
OpenAI's shape, and an assistant message's `tool_calls[].function.arguments` is a dict (the
Qwen 2.5 and Llama 3.1 templates render it with `tojson`), so the JSON string the API carries
is decoded for them.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pyserve.errors import InvalidRequestError
from pyserve.io_struct import new_rid
from pyserve.server.openai.structured import Constraint

STRICT = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(BaseModel):
    """A tool's function: `parameters` is a JSON Schema of its arguments (an object; none
    means no arguments). Other keys are passed to the chat template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: this function must be called."""

    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
# what the tools ask of a reply: none (no tools, or tool_choice none), auto (the model may call
# them: the default with tools), forced (tool_choice required or a named function)
ToolMode = Literal["none", "auto", "forced"]


def tool_mode(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolMode:
    if not tools or choice == "none":
        return "none"
    return "auto" if choice in (None, "auto") else "forced"


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    """InvalidRequestError for tools sharing a name, a forced tool_choice without tools, or a
    named function that is not among them."""
    names = [t.function.name for t in tools or ()]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: each function needs a name of its own", param="tools")
    if choice in (None, "auto", "none"):
        return
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if not tools:
        what = repr(choice) if named is None else f"function {named!r}"
        raise InvalidRequestError(f"tool_choice {what} needs tools", param="tool_choice")
    if named is not None and named not in names:
        raise InvalidRequestError(
            f"tool_choice names the function {named!r}, which is not among the tools", param="tool_choice"
        )


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    """A call in an assistant message of the conversation (as the API returned it)."""

    model_config = ConfigDict(extra="allow", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def to_template(self) -> dict[str, Any]:
        """The call as chat templates read it: arguments decoded to a dict when they are a
        JSON object (kept as text otherwise)."""
        out = self.model_dump(exclude_none=True)
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                out["function"]["arguments"] = decoded
        return out


def new_call_id() -> str:
    """A tool call's id: `call_` and 24 random hex digits (OpenAI's shape). Any thread."""
    return "call_" + new_rid()[:24]


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The `tools=` argument of apply_chat_template: the definitions in OpenAI's shape."""
    return [t.model_dump(exclude_none=True) for t in tools]


def forced_tools(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    """The tools a forced tool_choice allows: all of them (`required`) or the named one."""
    if isinstance(choice, NamedToolChoice):
        return [t for t in tools if t.function.name == choice.function.name]
    return list(tools)


def forced_constraint(tools: list[Tool] | None, choice: ToolChoice | None, max_calls: int | None) -> Constraint | None:
    """The grammar forcing a call (tool_choice required or a named function; its errors
    name `tools`), or None when the reply may answer without one. A named function is
    called once (as SGLang forces it); `required` makes up to max_calls calls."""
    if tools is None or choice is None or tool_mode(tools, choice) != "forced":
        return None
    if isinstance(choice, NamedToolChoice):
        max_calls = 1
    try:
        schema = forced_calls_schema(forced_tools(tools, choice), max_calls)
    except RecursionError:  # (copying or encoding a schema nested about 500 levels deep)
        raise InvalidRequestError("tools: a parameters schema is nested too deeply", param="tools") from None
    return Constraint("json_schema", schema, "tools")


def forced_calls_schema(tools: list[Tool], max_calls: int | None) -> str:
    """The JSON Schema (as text) of a forced reply: an array of 1..max_calls (None: any
    number) objects `{"name": <one tool's name>, "parameters": <its parameters>}`.

    Each tool's `$defs` (or `definitions`) move to the root, where its `$ref`s resolve once
    the parameters sit inside the array (renamed `<tool>.<name>` when two tools define the
    same name differently)."""
    root_defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        params = hoist_definitions(tool.function.name, tool.function.parameters, root_defs)
        items.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}}
    schema["minItems"] = 1
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if root_defs:
        schema["$defs"] = root_defs
    return json.dumps(schema, ensure_ascii=False)


def hoist_definitions(tool: str, parameters: dict[str, Any] | None, root_defs: dict[str, Any]) -> dict[str, Any]:
    """A copy of `parameters` (none: an object without properties) whose `$defs` /
    `definitions` moved into `root_defs`, references rewritten to `#/$defs/<name>`."""
    if parameters is None:
        return {"type": "object", "properties": {}}
    params = copy.deepcopy(parameters)
    renames: dict[str, str] = {}
    for key in ("$defs", "definitions"):
        defs = params.pop(key, None)
        if not isinstance(defs, dict):
            continue
        for name, definition in defs.items():
            new = name if root_defs.get(name, definition) == definition else f"{tool}.{name}"
            renames[f"#/{key}/{name}"] = f"#/$defs/{new}"
            root_defs[new] = definition
    if not renames:
        return params
    params = _rewrite_refs(params, renames)
    for name in {r.rsplit("/", 1)[1] for r in renames.values()}:
        root_defs[name] = _rewrite_refs(root_defs[name], renames)
    return params


def _rewrite_refs(node: Any, renames: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {
            k: (renames.get(v, v) if k == "$ref" and isinstance(v, str) else _rewrite_refs(v, renames))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rewrite_refs(v, renames) for v in node]
    return node
