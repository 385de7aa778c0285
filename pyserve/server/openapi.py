"""`GET /openapi.json`: an OpenAPI 3.1 document of the app's routes, built from its route table.

Each POST route's request body is the JSON Schema of the pydantic model its handler validates
(REQUEST_MODELS, the one place that says which model that is); the models' shared
definitions are components/schemas, referenced by `#/components/schemas/NAME`. GET, DELETE
and body-less POST operations have no request body. Every operation answers 200 (JSON; SSE
too where the model has a `stream` field) or a 4XX / 5XX error object
(components/schemas/ErrorResponse, what pyserve/server/errors.py and auth.py send on every
route, native ones included); /health's 503 is its `{"status"}` object instead.

The document is built on the first request and kept in `app.context.openapi_json` (bytes), so
it lists the routes the app has then (/metrics unless --disable-metrics). Loop thread.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.applications import Starlette
from starlette.convertors import FloatConvertor, IntegerConvertor, UUIDConvertor
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

import pyserve
from pyserve.io_struct import GenerateReqInput
from pyserve.server import expert_routes, metrics, native, parse_routes, tokenize
from pyserve.server.context import ServerContext
from pyserve.server.openai import embeddings, responses, serving
from pyserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from pyserve.server.openai.responses_protocol import ResponsesRequest
from pyserve.server.render import json_bytes

# The request body of each handler that takes POST: its pydantic model, or None for a POST
# that reads no body. A POST route whose handler is missing here fails
# tests/unit/test_openapi.py.
REQUEST_MODELS: dict[Callable[..., Any], type[BaseModel] | None] = {
    native.generate: GenerateReqInput,
    native.abort_request: native.AbortReq,
    native.flush_cache: None,
    expert_routes.start_record: None,
    expert_routes.stop_record: None,
    expert_routes.dump_record: None,
    parse_routes.separate_reasoning: parse_routes.SeparateReasoningRequest,
    parse_routes.parse_function_call: parse_routes.ParseFunctionCallRequest,
    serving.chat_completions: ChatCompletionRequest,
    serving.completions: CompletionRequest,
    tokenize.tokenize: tokenize.TokenizeRequest,
    tokenize.detokenize: tokenize.DetokenizeRequest,
    responses.create_response: ResponsesRequest,
    responses.stored_response: None,
    embeddings.embeddings: embeddings.EmbeddingRequest,
    embeddings.encode: embeddings.EncodeRequest,
}

# Handlers whose 200 is not a JSON body: the media type they send (None: an empty body).
OTHER_SUCCESS_MEDIA: dict[Callable[..., Any], str | None] = {
    native.health: None,
    metrics.metrics: "text/plain",
}

SCHEMA_REF = "#/components/schemas/{model}"

ERROR_SCHEMAS: dict[str, Any] = {
    "ErrorObject": {
        "type": "object",
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "integer", "null"]},
        },
        "required": ["message", "type", "param", "code"],
        "additionalProperties": False,
    },
    "ErrorResponse": {
        "type": "object",
        "properties": {"error": {"$ref": "#/components/schemas/ErrorObject"}},
        "required": ["error"],
        "additionalProperties": False,
    },
    "HealthStatus": {
        "type": "object",
        "properties": {"status": {"enum": ["loading", "draining", "failed"]}, "message": {"type": "string"}},
        "required": ["status"],
        "additionalProperties": False,
    },
}

_ERROR_RESPONSE = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def build_document(routes: list[BaseRoute]) -> dict[str, Any]:
    """The OpenAPI 3.1 document (a JSON-ready dict) of `routes`: their `Route`s' paths
    (`{name}` for path parameters), methods but HEAD, request bodies and responses."""
    models = sorted({m for m in REQUEST_MODELS.values() if m is not None}, key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=SCHEMA_REF)
    model_refs: dict[Any, dict[str, Any]] = {model: ref for (model, _), ref in refs.items()}
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route) or not route.include_in_schema:  # (the browser pages)
            continue
        item = paths.setdefault(route.path_format, {})
        for method in sorted((route.methods or set()) - {"HEAD"}):
            item[method.lower()] = _operation(route, method, model_refs)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pyserve",
            "version": pyserve.__version__,
            "description": "SGLang's native API and an OpenAI-compatible API (docs/api.md).",
        },
        "paths": paths,
        "components": {"schemas": {**defs.get("$defs", {}), **ERROR_SCHEMAS}},
    }


def _operation(route: Route, method: str, model_refs: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """One operation object: its path parameters, the POST body (REQUEST_MODELS), responses."""
    endpoint = route.endpoint
    op: dict[str, Any] = {"operationId": _operation_id(method, route.path_format)}
    doc = inspect.getdoc(endpoint)
    if doc:
        op["description"] = doc
    params = [
        {"name": name, "in": "path", "required": True, "schema": _param_schema(conv)}
        for name, conv in route.param_convertors.items()
    ]
    if params:
        op["parameters"] = params
    model = REQUEST_MODELS.get(endpoint) if method == "POST" else None
    if model is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": model_refs[model]}}}
    op["responses"] = {
        "200": _success(endpoint, model),
        "4XX": {"description": "the request is invalid (an error object)", **_ERROR_RESPONSE},
        "5XX": {"description": "the server failed or is unavailable (an error object)", **_ERROR_RESPONSE},
    }
    if endpoint is native.health:
        op["responses"]["503"] = {
            "description": "the model is loading or the server is draining",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HealthStatus"}}},
        }
    return op


def _success(endpoint: Callable[..., Any], model: type[BaseModel] | None) -> dict[str, Any]:
    if endpoint in OTHER_SUCCESS_MEDIA:
        media = OTHER_SUCCESS_MEDIA[endpoint]
        return {"description": "success", **({"content": {media: {}}} if media else {})}
    content: dict[str, Any] = {"application/json": {}}
    if model is not None and "stream" in model.model_fields:
        content["text/event-stream"] = {}  # the answer to `"stream": true`
    return {"description": "success", "content": content}


def _param_schema(convertor: object) -> dict[str, Any]:
    if isinstance(convertor, IntegerConvertor):
        return {"type": "integer", "minimum": 0}
    if isinstance(convertor, FloatConvertor):
        return {"type": "number", "minimum": 0}
    if isinstance(convertor, UUIDConvertor):
        return {"type": "string", "format": "uuid"}
    return {"type": "string"}


def _operation_id(method: str, path: str) -> str:
    """`post_v1_chat_completions`: unique per method and path."""
    words = "".join(c if c.isalnum() else " " for c in path).split()
    return "_".join([method.lower(), *words])


def document_bytes(app: Starlette) -> bytes:
    """The app's document as JSON bytes, built on the first call and kept in its context."""
    ctx: ServerContext = app.context  # type: ignore[attr-defined]
    if ctx.openapi_json is None:
        ctx.openapi_json = json_bytes(build_document(app.routes))
    return ctx.openapi_json


async def openapi_json(request: Request) -> Response:
    """GET /openapi.json: the OpenAPI 3.1 document of this server's routes."""
    return Response(document_bytes(request.app), media_type="application/json")


ROUTES = [Route("/openapi.json", openapi_json, methods=["GET"])]
