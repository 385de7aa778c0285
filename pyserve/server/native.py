"""Native routes (SGLang-compatible): /generate, /health, /get_model_info and /model_info,
/get_server_info and /server_info, /get_load, /flush_cache, /abort_request."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.engine.engine_core import EngineCore
from pyserve.errors import InvalidRequestError, ModelLoadingError, ServerDrainingError
from pyserve.forward_batch_info import EndCause
from pyserve.io_struct import GenerateReqInput, SingleReq
from pyserve.server.errors import parse_json
from pyserve.server.render import NativeStreamEncoder, SafeJSONResponse
from pyserve.server.sse import until_disconnect
from pyserve.server.stream_hub import StreamEncoder, StreamHub, StreamResponse, outputs_response


def stream_hub_of(request: Request) -> StreamHub:
    """The app's StreamHub (made on first use: an app driven without its lifespan has none)."""
    state = request.app.state
    hub = getattr(state, "stream_hub", None)
    if hub is None:
        hub = state.stream_hub = StreamHub()
    return hub


def engine_of(request: Request) -> EngineCore:
    """The app's EngineCore. Raises ModelLoadingError (503) while the model loads and
    ServerDrainingError (503) once the server drains."""
    state = request.app.state
    if getattr(state, "draining", False):
        raise ServerDrainingError()
    engine = getattr(state, "engine", None)
    if engine is None:
        raise ModelLoadingError()
    return engine


async def stream_response(request: Request, req: SingleReq, encode: StreamEncoder) -> StreamResponse:
    """The streamed response of `req` through the app's StreamHub, its events made by `encode`.
    A request the TokenizerManager refuses (invalid, queue full) raises here, before anything
    is sent; n > 1 requests are validated at their first step (an error response then)."""
    engine = engine_of(request)
    hub = stream_hub_of(request)
    if req.sampling_params.n > 1:
        return outputs_response(hub, encode, engine.generate(req))
    treq = await engine.tokenize_to_start(req)
    return StreamResponse(
        hub,
        encode,
        lambda stream: engine.start_stream(req, treq, stream.push),
        lambda: engine.forget(req.rid),
        lambda paused: engine.pause(req.rid, paused),
    )


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
    failure = getattr(request.app.state, "failure", None)
    if failure is not None:
        return SafeJSONResponse({"status": "failed", "message": failure}, status_code=503)
    if getattr(request.app.state, "draining", False):
        return SafeJSONResponse({"status": "draining"}, status_code=503)
    if getattr(request.app.state, "engine", None) is None:
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
    num = engine.end(engine.rids_of(body.rid, every=body.abort_all), EndCause.ABORTED, "aborted by /abort_request")
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
