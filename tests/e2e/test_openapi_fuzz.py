"""A schemathesis run against pyserve's OpenAPI document on a real stories260k server (about a
minute on two cores): every operation of /openapi.json gets requests generated from its schema,
valid and invalid (schemathesis' coverage phase, then FUZZ_EXAMPLES hypothesis examples per
operation, derandomized), and the four generation routes get valid streamed ones the same way
(STREAM_EXAMPLES; 180 to 350 whole streams each). No answer may be a 5xx, every 4xx is an
error object as the document describes it, and a 200 stream is whole without an event
reporting a server error. Afterwards the server is healthy, its log holds no unhandled
exception and no KV is leaked.

What is fuzzed is the document the server serves (checked first), leaning towards requests the
model serves quickly (`fuzzed`): output lengths are required and at most MAX_OUTPUT_TOKENS."""

from __future__ import annotations

import collections
import copy
import json
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from pyserve.config import ServerArgs
from pyserve.server.app import create_app
from pyserve.server.openapi import build_document
from tests.conftest import stories_chat_server

POOL = 4096
SERVER_ARGS = ["--context-length", "128", "--grammar-compile-timeout-s", "10"]
FUZZ_EXAMPLES = 200
STREAM_EXAMPLES = 60
MAX_OUTPUT_TOKENS = 4
# answers 200 and whole streams each generation route gets at least (this run's own figures are
# about twice these)
MIN_SERVED = 200
MIN_STREAMED = 90

# the document a server with default flags serves (test_served_document_is_fuzzed)
DOCUMENT = build_document(create_app(ServerArgs()).routes)

# (component, field): the output length fields of the request models, and their least value
OUTPUT_LENGTHS = {
    ("SamplingParams", "max_new_tokens"): 0,
    ("ChatCompletionRequest", "max_tokens"): 0,
    ("ChatCompletionRequest", "max_completion_tokens"): 0,
    ("CompletionRequest", "max_tokens"): 0,
    ("ResponsesRequest", "max_output_tokens"): 1,
}
# the field each model must then carry (chat: max_completion_tokens, when given, overrides it)
REQUIRED_LENGTHS = {
    "SamplingParams": "max_new_tokens",
    "ChatCompletionRequest": "max_tokens",
    "CompletionRequest": "max_tokens",
    "ResponsesRequest": "max_output_tokens",
}
# the request models with a `stream` field
STREAMING = ["GenerateReqInput", "ChatCompletionRequest", "CompletionRequest", "ResponsesRequest"]
# a token id of stories260k (its vocabulary has 512)
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": 511}


def require(schema: dict[str, Any], field: str) -> None:
    schema["required"] = sorted({*schema.get("required", []), field})


def fuzzed(document: dict[str, Any]) -> dict[str, Any]:
    """`document` leaning towards requests the model serves, quickly: every output length is
    required and at most MAX_OUTPUT_TOKENS; `stream` is required (an optional field is left
    out of most generated bodies); the fields typed "any" (SGLang's, accepted only unset) are
    null; /generate's body has one of `text` and `input_ids` and one sampling_params object,
    which the model's validators require and its schema cannot say."""
    doc = copy.deepcopy(document)
    schemas = doc["components"]["schemas"]
    for component in schemas.values():
        for name, prop in component.get("properties", {}).items():
            if not set(prop) - {"default", "title", "description"}:
                component["properties"][name] = {"type": "null"}
    for (component, field), least in OUTPUT_LENGTHS.items():
        # (an enum: schemathesis writes some integers of an integer schema as whole floats, 2.0,
        # which the strict models refuse with a 400)
        schemas[component]["properties"][field] = {"enum": list(range(least, MAX_OUTPUT_TOKENS + 1))}
    for component, field in REQUIRED_LENGTHS.items():
        require(schemas[component], field)
    for component in STREAMING:
        require(schemas[component], "stream")
    generate = schemas["GenerateReqInput"]
    generate["properties"]["sampling_params"] = {"$ref": "#/components/schemas/SamplingParams"}
    require(generate, "sampling_params")
    generate["oneOf"] = [
        {"required": ["text"], "properties": {"text": {"type": ["string", "array"]}, "input_ids": {"type": "null"}}},
        {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}, "text": {"type": "null"}}},
    ]
    return doc


def streamed(document: dict[str, Any]) -> dict[str, Any]:
    """`fuzzed(document)` whose generation requests all stream one prompt (a list of prompts
    cannot stream): text, or ids in the vocabulary."""
    doc = fuzzed(document)
    schemas = doc["components"]["schemas"]
    for component in STREAMING:
        schemas[component]["properties"]["stream"] = {"const": True}
    ids = {"type": "array", "items": TOKEN_ID, "minItems": 1}
    schemas["GenerateReqInput"]["oneOf"] = [
        {"required": ["text"], "properties": {"text": {"type": "string"}, "input_ids": {"type": "null"}}},
        {"required": ["input_ids"], "properties": {"input_ids": ids, "text": {"type": "null"}}},
    ]
    schemas["CompletionRequest"]["properties"]["prompt"] = {"anyOf": [{"type": "string"}, ids]}
    return doc


def config(**generation: Any) -> schemathesis.Config:
    return schemathesis.Config.from_dict(
        {
            "generation": generation,
            "max-stream-events": 10_000,  # read every stream to its end
            "request-timeout": 60,
        }
    )


# valid bodies and invalid ones; the coverage phase first (each schema's boundary values and
# missing fields), then hypothesis
schema = schemathesis.openapi.from_dict(fuzzed(DOCUMENT), config=config(mode="all"))
streamed_schema = schemathesis.openapi.from_dict(streamed(DOCUMENT), config=config(mode="positive")).include(
    method="POST", path=["/generate", "/v1/chat/completions", "/v1/completions", "/v1/responses"]
)
SETTINGS = {
    "derandomize": True,
    "database": None,
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
}

# a 4xx body must validate against the document's ErrorResponse (its refs resolved in it)
ERROR_VALIDATOR = jsonschema.Draft202012Validator(
    {"$ref": "#/components/schemas/ErrorResponse", "components": DOCUMENT["components"]}
)
# the last event of a /v1/responses stream (it sends no `data: [DONE]`)
RESPONSES_ENDS = {"response.completed", "response.incomplete", "response.failed"}
# (type, code) of an error in a stream saying the server failed: the error event of the chat,
# completions and native routes, /v1/responses' `response.failed`
SERVER_FAILURES = {("internal_server_error", 500), (None, "server_error")}

# what the run got: answers per (operation, status), whole 200 streams checked per operation
STATUSES: collections.Counter[tuple[str, int]] = collections.Counter()
STREAMS: collections.Counter[str] = collections.Counter()
GENERATION = ["POST /generate", "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_path):
    yield from stories_chat_server(tmp_path_factory, stories_path, "openapi-fuzz", POOL, SERVER_ARGS)


def error_object_and_whole_streams(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """A 4xx is JSON validating against ErrorResponse; a 200 event stream is whole (it ends
    with `data: [DONE]`, /v1/responses' with its terminal event), each event JSON, none
    reporting a server error (an error event of the request's own fault, a 4xx code, is how a
    stream that has started refuses)."""
    status = response.status_code
    if 400 <= status < 500:
        errors = [e.message for e in ERROR_VALIDATOR.iter_errors(json.loads(response.content))]
        assert not errors, f"{status}: {errors}: {response.content[:500]!r}"
        return
    media = response.headers.get("content-type", [""])[0]
    if status != 200 or not media.startswith("text/event-stream"):
        return
    assert not response.stream_cut_short
    events = [
        next(line[6:] for line in event.split("\n") if line.startswith("data: "))
        for event in response.content.decode().split("\n\n")[:-1]
    ]
    if events[-1] == "[DONE]":
        events.pop()
    else:
        assert json.loads(events[-1])["type"] in RESPONSES_ENDS, events[-1]
    for data in events:
        obj = json.loads(data)
        error = obj.get("error") or (obj.get("response") or {}).get("error")
        assert error is None or (error.get("type"), error.get("code")) not in SERVER_FAILURES, obj
    STREAMS[f"{case.method} {case.operation.path}"] += 1


def call_and_check(case: schemathesis.Case, base_url: str) -> None:
    response = case.call(base_url=base_url)
    STATUSES[(f"{case.method} {case.operation.path}", response.status_code)] += 1
    case.validate_response(response, checks=[not_a_server_error, error_object_and_whole_streams])


def test_served_document_is_fuzzed(server):
    r = httpx.get(server.base_url + "/openapi.json")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == DOCUMENT


@schema.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, **SETTINGS)
def test_no_server_errors(case: schemathesis.Case, server) -> None:
    call_and_check(case, server.base_url)


@streamed_schema.parametrize()
@settings(max_examples=STREAM_EXAMPLES, **SETTINGS)
def test_no_server_errors_streamed(case: schemathesis.Case, server) -> None:
    call_and_check(case, server.base_url)


def test_server_fine_afterwards(server):
    if STATUSES:  # (after the run, not alone): it reached the model and streamed on every route
        print("fuzz statuses:", sorted(STATUSES.items()), "streams:", sorted(STREAMS.items()))
        for op in GENERATION:
            assert STATUSES[(op, 200)] >= MIN_SERVED and STREAMS[op] >= MIN_STREAMED, (op, STATUSES, STREAMS)
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        assert client.get("/health").status_code == 200
        ok = client.post("/generate", json={"text": "Tom", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-5000:]
