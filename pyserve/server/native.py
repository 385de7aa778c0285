"""Native routes (SGLang-compatible): /generate, /health, /get_model_info and /model_info,
/get_server_info and /server_info, /get_load, /flush_cache, /abort_request."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.errors import InvalidRequestError
from pyserve.forward_batch_info import ABORTED_MESSAGE, EndCause
from pyserve.io_struct import GenerateReqInput
from pyserve.server.context import context_of, engine_of
from pyserve.server.render import NativeStreamEncoder, SafeJSONResponse
from pyserve.server.request_body import parse_json
from pyserve.server.sse import until_disconnect
from pyserve.server.stream_hub import StreamResponse
from pyserve.server.stream_start import stream_response


async def generate(request: Request) -> Response | StreamResponse:
    """POST /generate: text or input_ids, single or a list; SSE when stream is true."""
    obj = GenerateReqInput.model_validate(await parse_json(request))
    engine = engine_of(request)
    engine.resolve_model(obj.model)
    reqs = obj.split()
    if obj.stream:
        return await stream_response(request, reqs[0], NativeStreamEncoder())
    outs = await until_disconnect(request, engine.generate_all(reqs))
    dicts = [o.to_native() for o in outs]
    # a list for a list of prompts or n > 1 samples (SGLang's shape), else one object
    return SafeJSONResponse(dicts if obj.is_batch or len(dicts) > 1 else dicts[0])


async def health(request: Request) -> Response:
    """200 with an empty body once the model is loaded; 503 {"status": "loading"} before,
    {"status": "draining"} once the server shuts down, {"status": "failed", "message"} once
    serving failed for good (a tensor-parallel rank died)."""
    ctx = context_of(request)
    if ctx.failure is not None:
        return SafeJSONResponse({"status": "failed", "message": ctx.failure}, status_code=503)
    if ctx.draining:
        return SafeJSONResponse({"status": "draining"}, status_code=503)
    if ctx.engine is None:
        return SafeJSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
    return Response(status_code=200)


async def get_model_info(request: Request) -> Response:
    return SafeJSONResponse(engine_of(request).get_model_info())


async def get_server_info(request: Request) -> Response:
    return SafeJSONResponse(engine_of(request).get_server_info())


async def get_load(request: Request) -> Response:
    """GET /get_load: what sglang-router's load-aware policies read (SGLang's shape)."""
    return SafeJSONResponse(engine_of(request).get_load())


async def flush_cache(request: Request) -> Response:
    """GET or POST /flush_cache: empty the radix cache; 400 while requests are queued or run."""
    if not engine_of(request).flush_cache():
        raise InvalidRequestError("cannot flush the cache while requests are queued or running; retry when idle")
    return SafeJSONResponse({"success": True, "message": "Cache flushed."})


class AbortReq(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str | None = None
    abort_all: bool = False


async def abort_request(request: Request) -> Response:
    """POST /abort_request {"rid": ...} or {"abort_all": true}: end running requests (their
    consumers get finish reason abort, their KV is freed). An unknown rid is not an error (it
    may have just finished), as in SGLang."""
    body = AbortReq.model_validate(await parse_json(request))
    if body.rid is None and not body.abort_all:
        raise InvalidRequestError("give 'rid' or 'abort_all': true", param="rid")
    engine = engine_of(request)
    num = engine.end(engine.rids_of(body.rid, every=body.abort_all), EndCause.ABORTED, ABORTED_MESSAGE)
    return SafeJSONResponse({"success": True, "num_aborted": num})


ROUTES = [
    Route("/generate", generate, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/health_generate", health, methods=["GET"]),
    Route("/get_model_info", get_model_info, methods=["GET"]),
    Route("/get_server_info", get_server_info, methods=["GET"]),
    # the names newer SGLang clients (sglang-router) try first
    Route("/model_info", get_model_info, methods=["GET"]),
    Route("/server_info", get_server_info, methods=["GET"]),
    Route("/get_load", get_load, methods=["GET"]),
    Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
    Route("/abort_request", abort_request, methods=["POST"]),
]
