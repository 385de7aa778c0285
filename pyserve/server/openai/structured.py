"""Structured output on the OpenAI routes: which request field asks for which grammar.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`, and SGLang's
`structural_tag`), SGLang's top-level `json_schema`, `regex`, `ebnf`, `structural_tag`, and
vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` all become one of
SamplingParams' grammar fields (`json_schema`, `regex`, `ebnf`, `structural_tag`), at most one
per request. The field a grammar came from stays known (`Constraint.param`), so that the
compiler's refusal of it names that field in the 400.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyserve.errors import InvalidRequestError
from pyserve.io_struct import GenerateOutput, SingleReq, TokenizedGenerateReq

if TYPE_CHECKING:
    from pyserve.engine.engine_core import EngineCore

# the top-level fields that ask for a grammar (SGLang's, then vLLM's)
GRAMMAR_FIELDS = (
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# response_format types
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
# the fields each type takes (structural_tag: its own, checked by the compiler)
_RESPONSE_FORMAT_FIELDS = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}


@dataclass(frozen=True)
class Constraint:
    """A request's grammar: `kind` (one of SamplingParams' GRAMMAR_KINDS: json_schema, regex,
    ebnf or structural_tag, the name the engine's errors give as `param`), its `text`, and
    `param`, the request field it came from."""

    kind: str
    text: str
    param: str


def json_text(value: str | dict[str, Any], param: str) -> str:
    """A JSON schema (or structural tag) given as an object or as JSON text, as text
    (InvalidRequestError naming `param` for an object nested too deeply to encode)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:
        raise InvalidRequestError(f"{param}: nested too deeply", param=param) from None


def response_format_constraint(response_format: dict[str, Any] | None) -> Constraint | None:
    """The grammar `response_format` asks for (None for none or `text`). Raises
    InvalidRequestError (param "response_format") for a malformed one."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise InvalidRequestError(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
            param="response_format",
        )
    if kind != "structural_tag":  # a field the type does not take would change nothing: refused
        extra = sorted(set(response_format) - _RESPONSE_FORMAT_FIELDS[kind])
        if extra:
            raise InvalidRequestError(
                f"response_format of type {kind} takes no field {extra[0]!r}", param=f"response_format.{extra[0]}"
            )
    if kind == "text":
        return None
    if kind == "json_object":
        # Together's and Fireworks' form names the object's schema here
        schema = response_format.get("schema")
        if schema is None:
            return Constraint("json_schema", '{"type": "object"}', "response_format")
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format.schema must be a JSON Schema object", param="response_format.schema"
            )
        return Constraint("json_schema", json_text(schema, "response_format"), "response_format")
    if kind == "structural_tag":  # SGLang's: {"type": "structural_tag", "structures": [...], "triggers": [...]}
        return Constraint("structural_tag", json_text(response_format, "response_format"), "response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError(
            "response_format of type json_schema needs a json_schema object: "
            '{"name": ..., "schema": {...}, "strict": ...}',
            param="response_format",
        )
    schema = spec.get("schema", spec.get("schema_"))  # (pydantic-made bodies may say schema_)
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            "response_format.json_schema.schema is required: the JSON Schema (an object) of the reply",
            param="response_format",
        )
    return Constraint("json_schema", json_text(schema, "response_format"), "response_format")


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (vLLM's guided_choice)."""
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices)


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (quotes, backslashes and control characters escaped)."""
    out = ['"']
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif c == "\r":
            out.append("\\r")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    out.append('"')
    return "".join(out)


def field_constraints(fields: dict[str, Any]) -> list[Constraint]:
    """The grammars asked for by the top-level fields (name -> value, None when unset):
    SGLang's json_schema, regex, ebnf, structural_tag and vLLM's guided_* fields."""
    out = []
    for name, value in fields.items():
        if value is None:
            continue
        if name in ("json_schema", "guided_json"):
            out.append(Constraint("json_schema", json_text(value, name), name))
        elif name in ("regex", "guided_regex"):
            out.append(Constraint("regex", value, name))
        elif name in ("ebnf", "guided_grammar"):
            out.append(Constraint("ebnf", value, name))
        elif name == "structural_tag":
            out.append(Constraint("structural_tag", json_text(value, name), name))
        elif name == "guided_choice":
            if not value:
                raise InvalidRequestError("guided_choice needs at least one choice", param=name)
            out.append(Constraint("ebnf", choice_ebnf(value), name))
        else:
            raise ValueError(f"not a grammar field: {name}")
    return out


def one_constraint(constraints: list[Constraint]) -> Constraint | None:
    """The request's grammar; InvalidRequestError (param: the second field) when more than
    one field asks for one."""
    if len(constraints) > 1:
        first, second = constraints[0].param, constraints[1].param
        raise InvalidRequestError(
            f"give at most one of response_format, json_schema, regex, ebnf, structural_tag, guided_json, "
            f"guided_regex, guided_choice, guided_grammar and a forced tool_choice; got {first} and {second}",
            param=second,
        )
    return constraints[0] if constraints else None


# ---- the engine's refusal of a grammar, named by the request's field --------------------------
def rename_param(exc: InvalidRequestError, constraint: Constraint | None) -> InvalidRequestError:
    """`exc` with `param` (and the message's leading field name) changed from the engine's
    grammar field to the request field the grammar came from; other errors as they are."""
    if constraint is not None and exc.param == constraint.kind:
        exc.param = constraint.param
        prefix = constraint.kind + ":"
        if exc.message.startswith(prefix):
            exc.message = constraint.param + ":" + exc.message[len(prefix) :]
            exc.args = (exc.message,)
    return exc


async def tokenize_to_start(engine: EngineCore, req: SingleReq, constraint: Constraint | None) -> TokenizedGenerateReq:
    """`req` tokenized and admitted to start (EngineCore.tokenize_to_start), as a route does
    before its stream's 200; a refusal names the request field (rename_param)."""
    try:
        treq = await engine.tokenize_to_start(req)
    except InvalidRequestError as exc:
        raise rename_param(exc, constraint) from None
    return treq


def renamed_output(out: GenerateOutput, constraint: Constraint | None) -> GenerateOutput:
    """`out` with a grammar failure's `param` named by the request field (in place)."""
    reason = out.finish_reason
    if constraint is not None and reason is not None and reason.param == constraint.kind:
        message = reason.message or ""
        prefix = constraint.kind + ":"
        if message.startswith(prefix):
            message = constraint.param + ":" + message[len(prefix) :]
        out.finish_reason = dataclasses.replace(reason, param=constraint.param, message=message)
    return out


async def renamed_outputs(
    outputs: AsyncIterator[GenerateOutput], constraint: Constraint | None
) -> AsyncIterator[GenerateOutput]:
    """`outputs` with a grammar failure (raised) named by the request field."""
    try:
        async for out in outputs:
            yield out
    except InvalidRequestError as exc:
        raise rename_param(exc, constraint) from None
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
