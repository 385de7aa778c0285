"""OpenAI routes' structured output fields (pyserve/server/openai/structured.py, protocol.py):
which field becomes which SamplingParams grammar field with which text, the 400s (a conflict
names the second field; json_schema without schema), and the engine's refusal of a grammar
renamed to the request field it came from."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from pyserve.errors import InvalidRequestError
from pyserve.forward_batch_info import EndCause, FinishReason
from pyserve.io_struct import GenerateOutput
from pyserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from pyserve.server.openai.structured import (
    Constraint,
    choice_ebnf,
    ebnf_literal,
    rename_param,
    renamed_output,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def refused(body_or_make, param: str) -> str:
    with pytest.raises(InvalidRequestError) as info:
        body = body_or_make() if callable(body_or_make) else body_or_make
        body.check_supported()
        body.constraint()
    assert info.value.param == param and info.value.status == 400
    return info.value.message


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize(
    "fields,kind,text,param",
    [
        ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}', "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": SCHEMA, "strict": True},
                }
            },
            "json_schema",
            json.dumps(SCHEMA),
            "response_format",
        ),
        ({"json_schema": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA), "json_schema"),
        ({"json_schema": SCHEMA}, "json_schema", json.dumps(SCHEMA), "json_schema"),
        ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA), "guided_json"),
        ({"guided_json": '{"type": "string"}'}, "json_schema", '{"type": "string"}', "guided_json"),
        ({"regex": "[0-9]+"}, "regex", "[0-9]+", "regex"),
        ({"guided_regex": "(yes|no)"}, "regex", "(yes|no)", "guided_regex"),
        ({"ebnf": 'root ::= "a"'}, "ebnf", 'root ::= "a"', "ebnf"),
        ({"guided_grammar": 'root ::= "b"'}, "ebnf", 'root ::= "b"', "guided_grammar"),
        (
            {"guided_choice": ["yes", 'n"o\\'], "guided_json": None},
            "ebnf",
            'root ::= "yes" | "n\\"o\\\\"',
            "guided_choice",
        ),
        (
            {"structural_tag": '{"type": "structural_tag"}'},
            "structural_tag",
            '{"type": "structural_tag"}',
            "structural_tag",
        ),
        (  # Together's and Fireworks' form: json_object with the object's schema
            {"response_format": {"type": "json_object", "schema": SCHEMA}},
            "json_schema",
            json.dumps(SCHEMA),
            "response_format",
        ),
        (
            {"response_format": {"type": "structural_tag", "structures": [], "triggers": []}},
            "structural_tag",
            '{"type": "structural_tag", "structures": [], "triggers": []}',
            "response_format",
        ),
    ],
)
def test_each_field_becomes_one_grammar(make, fields, kind, text, param):
    body = make(**fields)
    body.check_supported()
    assert body.constraint() == Constraint(kind, text, param)
    sp = body.sampling_params(16, body.constraint())
    assert sp.grammar_key == (kind, text)
    others = {"json_schema", "regex", "ebnf", "structural_tag"} - {kind}
    assert all(getattr(sp, k) is None for k in others)


@pytest.mark.parametrize("make", [chat, completion])
def test_no_grammar_without_a_field(make):
    for fields in ({}, {"response_format": {"type": "text"}}, {"regex": None, "guided_choice": None}):
        body = make(**fields)
        body.check_supported()
        assert body.constraint() is None
        assert body.sampling_params(16, None).grammar_key is None


def test_conflicts_name_the_second_field():
    message = refused(chat(response_format={"type": "json_object"}, regex="a"), "regex")
    assert "got response_format and regex" in message
    refused(completion(guided_json=SCHEMA, guided_choice=["a"]), "guided_choice")
    refused(completion(ebnf='root ::= "a"', guided_grammar='root ::= "a"'), "guided_grammar")
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    body = chat(response_format={"type": "json_object"}, tools=tools, tool_choice="required")
    assert "got response_format and tools" in refused(body, "tools")


def test_malformed_response_format_is_refused_by_name():
    for rf in (
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}},
        {"type": "xml"},
        {},
    ):
        refused(chat(response_format=rf), "response_format")
    assert "schema is required" in refused(
        completion(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"
    )


def test_fields_a_response_format_type_does_not_take_are_refused():
    """A field that would change nothing is refused by name, not ignored."""
    message = refused(
        chat(response_format={"type": "text", "json_schema": {"schema": SCHEMA}}), "response_format.json_schema"
    )
    assert message == "response_format of type text takes no field 'json_schema'"
    refused(
        completion(response_format={"type": "json_object", "json_schema": {"schema": SCHEMA}}),
        "response_format.json_schema",
    )
    refused(
        chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}, "schema": {}}),
        "response_format.schema",
    )
    refused(chat(response_format={"type": "json_object", "schema": "{}"}), "response_format.schema")


def test_still_unsupported_fields_are_refused():
    refused(chat(guided_whitespace_pattern=r"\s*"), "guided_whitespace_pattern")
    refused(chat(functions=[{"name": "f"}]), "functions")
    refused(completion(guided_choice=[]), "guided_choice")


def test_wrong_types_fail_validation():
    from pydantic import ValidationError

    for fields in ({"regex": 5}, {"guided_choice": "a"}, {"guided_choice": [1]}, {"json_schema": [1]}):
        with pytest.raises(ValidationError):
            completion(**fields)


def test_guided_choice_grammar_accepts_exactly_the_choices():
    choices = ["yes", "no way", 'say "hi"', "back\\slash", "new\nline\ttab", "é日本", "\x01"]
    assert ebnf_literal('a"b\\c\n\x01') == '"a\\"b\\\\c\\n\\x01"'
    grammar = xgr.Grammar.from_ebnf(choice_ebnf(choices))
    for c in choices:
        assert xgr.testing._is_grammar_accept_string(grammar, c), c
    for c in ["ye", "yes ", "no", 'say "hi', "back\\\\slash", ""]:
        assert not xgr.testing._is_grammar_accept_string(grammar, c), c


def test_engine_refusal_is_renamed_to_the_request_field():
    constraint = Constraint("json_schema", "{}", "response_format")
    exc = rename_param(InvalidRequestError("json_schema: invalid JSON schema: bad", param="json_schema"), constraint)
    assert (exc.param, exc.message, str(exc)) == (
        "response_format",
        "response_format: invalid JSON schema: bad",
        "response_format: invalid JSON schema: bad",
    )
    other = rename_param(InvalidRequestError("prompt too long", param="prompt"), constraint)
    assert (other.param, other.message) == ("prompt", "prompt too long")
    same = rename_param(InvalidRequestError("x", param="json_schema"), None)
    assert same.param == "json_schema"

    out = GenerateOutput(
        "r",
        "",
        "",
        [],
        [],
        3,
        0,
        FinishReason.abort(EndCause.GRAMMAR_REFUSED, "json_schema: invalid: x", "json_schema"),
    )
    renamed = renamed_output(out, Constraint("json_schema", "{}", "guided_json")).finish_reason
    assert renamed is not None
    assert (renamed.param, renamed.message, renamed.cause) == (
        "guided_json",
        "guided_json: invalid: x",
        EndCause.GRAMMAR_REFUSED,
    )
    stop = GenerateOutput("r", "", "", [], [], 3, 0, FinishReason.stop(2))
    assert renamed_output(stop, constraint).finish_reason == FinishReason.stop(2)
