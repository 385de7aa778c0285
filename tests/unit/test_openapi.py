"""/openapi.json: every route of the app is in the document, every POST route with its request
model (or declared body-less), the document is valid OpenAPI 3.1 whose schemas are the models'
own, it is built once per app and protected by the API key like the other routes."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import schemathesis
from starlette.routing import Route
from starlette.testclient import TestClient

from pyserve.config import ServerArgs
from pyserve.io_struct import GenerateReqInput
from pyserve.server import openapi
from pyserve.server.app import create_app
from pyserve.server.openapi import ERROR_SCHEMAS, REQUEST_MODELS, build_document
from pyserve.server.render import error_body

# (method, path) of every operation of a server with default flags (metrics on)
OPERATIONS = [
    ("get", "/flush_cache"),
    ("get", "/get_load"),
    ("get", "/get_model_info"),
    ("get", "/get_server_info"),
    ("get", "/health"),
    ("get", "/health_generate"),
    ("get", "/metrics"),
    ("get", "/model_info"),
    ("get", "/openapi.json"),
    ("get", "/server_info"),
    ("get", "/v1/models"),
    ("get", "/v1/models/{model_id}"),
    ("get", "/v1/responses/{response_id}"),
    ("delete", "/v1/responses/{response_id}"),
    ("post", "/abort_request"),
    ("post", "/detokenize"),
    ("post", "/dump_expert_distribution_record"),
    ("post", "/encode"),
    ("post", "/flush_cache"),
    ("post", "/generate"),
    ("post", "/parse_function_call"),
    ("post", "/separate_reasoning"),
    ("post", "/start_expert_distribution_record"),
    ("post", "/stop_expert_distribution_record"),
    ("post", "/tokenize"),
    ("post", "/v1/chat/completions"),
    ("post", "/v1/completions"),
    ("post", "/v1/detokenize"),
    ("post", "/v1/embeddings"),
    ("post", "/v1/responses"),
    ("post", "/v1/responses/{response_id}"),
    ("post", "/v1/tokenize"),
]
# the request body of each POST operation: the component its schema refers to (None: no body)
POST_BODIES = {
    "/abort_request": "AbortReq",
    "/detokenize": "DetokenizeRequest",
    "/encode": "EncodeRequest",
    "/flush_cache": None,
    "/start_expert_distribution_record": None,
    "/stop_expert_distribution_record": None,
    "/dump_expert_distribution_record": None,
    "/generate": "GenerateReqInput",
    "/parse_function_call": "ParseFunctionCallRequest",
    "/separate_reasoning": "SeparateReasoningRequest",
    "/tokenize": "TokenizeRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/detokenize": "DetokenizeRequest",
    "/v1/embeddings": "EmbeddingRequest",
    "/v1/responses": "ResponsesRequest",
    "/v1/responses/{response_id}": None,
    "/v1/tokenize": "TokenizeRequest",
}
ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}


@pytest.fixture(scope="module")
def app():
    return create_app(ServerArgs())


@pytest.fixture(scope="module")
def doc(app) -> dict[str, Any]:
    return build_document(app.routes)


def refs(obj: Any) -> list[str]:
    """Every "$ref" value in `obj`."""
    out, stack = [], [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            out.extend(v for k, v in value.items() if k == "$ref")
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return out


def test_every_post_route_has_its_request_model(app, doc):
    routes = app.routes
    assert all(isinstance(route, Route) for route in routes)  # (nothing escapes the walk)
    posts = [route for route in routes if "POST" in (route.methods or ())]
    assert len(posts) == 18
    for route in posts:
        assert route.endpoint in REQUEST_MODELS, f"POST {route.path}: add its request model to REQUEST_MODELS"
        model = REQUEST_MODELS[route.endpoint]
        op = doc["paths"][route.path_format]["post"]
        if model is None:
            assert "requestBody" not in op
        else:
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            assert op["requestBody"] == {"required": True, "content": {"application/json": {"schema": ref}}}


def test_operations_and_bodies(doc):
    ops = [(method, path) for path, item in doc["paths"].items() for method in item]
    assert sorted(ops) == sorted(OPERATIONS)
    bodies = {
        path: item["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        if "requestBody" in item["post"]
        else None
        for path, item in doc["paths"].items()
        if "post" in item
    }
    assert bodies == POST_BODIES
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(set(ids)) == len(ids)
    assert doc["paths"]["/v1/chat/completions"]["post"]["operationId"] == "post_v1_chat_completions"
    assert doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"] == [
        {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]


def test_metrics_only_when_served():
    doc = build_document(create_app(ServerArgs(enable_metrics=False)).routes)
    assert "/metrics" not in doc["paths"]
    assert len(doc["paths"]) == 28


def test_responses(doc):
    generate = doc["paths"]["/generate"]["post"]["responses"]
    assert generate == {
        "200": {"description": "success", "content": {"application/json": {}, "text/event-stream": {}}},
        "4XX": {"description": "the request is invalid (an error object)", "content": ERROR_CONTENT},
        "5XX": {"description": "the server failed or is unavailable (an error object)", "content": ERROR_CONTENT},
    }
    assert doc["paths"]["/v1/tokenize"]["post"]["responses"]["200"]["content"] == {"application/json": {}}
    assert doc["paths"]["/health"]["get"]["responses"]["200"] == {"description": "success"}
    assert doc["paths"]["/health"]["get"]["responses"]["503"]["content"] == {
        "application/json": {"schema": {"$ref": "#/components/schemas/HealthStatus"}}
    }
    assert doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"] == {"text/plain": {}}
    for item in doc["paths"].values():
        for op in item.values():
            assert op["responses"]["4XX"]["content"] == ERROR_CONTENT


def test_valid_openapi_31_with_the_models_schemas(doc):
    assert doc["openapi"] == "3.1.0"
    schemathesis.openapi.from_dict(doc).validate()  # the OpenAPI 3.1 specification's schema
    schemas = doc["components"]["schemas"]
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    prefix = "#/components/schemas/"
    assert all(ref.startswith(prefix) and ref[len(prefix) :] in schemas for ref in refs(doc))
    own = GenerateReqInput.model_json_schema(ref_template=prefix + "{model}")
    assert schemas["GenerateReqInput"] == {k: v for k, v in own.items() if k != "$defs"}
    assert schemas["SamplingParams"] == own["$defs"]["SamplingParams"]
    # two models named TextPart (chat content parts, responses input parts) stay apart
    assert sorted(name for name in schemas if name.endswith("TextPart")) == [
        "pyserve__server__openai__protocol__TextPart",
        "pyserve__server__openai__responses_protocol__TextPart",
    ]


def error_validator(schemas: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """A validator of ErrorResponse, its refs resolved in `schemas`."""
    return jsonschema.Draft202012Validator(
        {"$ref": "#/components/schemas/ErrorResponse", "components": {"schemas": schemas}}
    )


def test_error_schema_describes_the_error_bodies():
    validator = error_validator(ERROR_SCHEMAS)
    validator.validate(error_body("bad", param="x", code="c"))
    validator.validate(error_body("bad", type_="internal_server_error", code=500))
    assert not validator.is_valid({"error": {"message": "m", "type": "t", "param": None}})
    assert not validator.is_valid({"detail": "Not Found"})


def test_served_once_per_app(app, doc):
    client = TestClient(app)  # (no lifespan: the document needs no model)
    r = client.get("/openapi.json")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == doc
    cached = app.context.openapi_json
    assert client.get("/openapi.json").content == r.content
    assert openapi.document_bytes(app) is cached
    # a body its schema refuses gets the 4XX the document describes
    bad = client.post("/generate", json={"text": "x", "stream": "yes"})
    assert bad.status_code == 400
    assert bad.json() == {
        "error": {
            "message": "stream: Input should be a valid boolean",
            "type": "invalid_request_error",
            "param": "stream",
            "code": None,
        }
    }
    error_validator(doc["components"]["schemas"]).validate(bad.json())


def test_protected_by_the_api_key():
    client = TestClient(create_app(ServerArgs(api_key="k")))
    r = client.get("/openapi.json")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/openapi.json", headers={"Authorization": "Bearer k"}).status_code == 200
