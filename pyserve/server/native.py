"""Native routes (SGLang-compatible): /generate, /health, /get_model_info, /get_server_info."""

from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pyserve.engine.engine_core import EngineCore
from pyserve.io_struct import GenerateReqInput
from pyserve.server.errors import parse_json
from pyserve.server.sse import sse_response, until_disconnect


def engine_of(request: Request) -> EngineCore:
    return request.app.state.engine


async def generate(request: Request) -> Response:
    """POST /generate: text or input_ids, single or a list; SSE when stream is true."""
    obj = GenerateReqInput.model_validate(await parse_json(request))
    engine = engine_of(request)
    reqs = obj.split()
    if obj.stream:
        stream = engine.generate(reqs[0])
        first = await anext_or_none(stream)  # errors surface here, before the 200 is sent
        return sse_response(_chain(first, stream, lambda o: o.to_native()))
    outs = await until_disconnect(request, engine.generate_all(reqs))
    dicts = [o.to_native() for o in outs]
    return JSONResponse(dicts if obj.is_batch else dicts[0])


async def anext_or_none(it):  # type: ignore[no-untyped-def]
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(first, rest, convert) -> AsyncIterator:  # type: ignore[no-untyped-def]
    try:
        if first is not None:
            yield convert(first)
            async for item in rest:
                yield convert(item)
    finally:
        await rest.aclose()


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def get_model_info(request: Request) -> Response:
    return JSONResponse(engine_of(request).get_model_info())


async def get_server_info(request: Request) -> Response:
    return JSONResponse(engine_of(request).get_server_info())


ROUTES = [
    Route("/generate", generate, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/health_generate", health, methods=["GET"]),
    Route("/get_model_info", get_model_info, methods=["GET"]),
    Route("/get_server_info", get_server_info, methods=["GET"]),
]
