"""`ServerContext`: what the routes of one app share, typed, in place of Starlette's untyped
`app.state`: the engine (None while the model loads), the stream hub every streamed response
goes through, the drain and failure state, the request-size limit and the caches a route
keeps (the OpenAPI document, the metrics registry). `create_app` makes one per app
(`PyserveApp.context`); its lifespan fills in the engine. Loop thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from starlette.requests import Request

from pyserve.errors import ModelLoadingError, ServerDrainingError
from pyserve.server.stream_hub import StreamHub

if TYPE_CHECKING:
    from pyserve.engine.engine_core import EngineCore


@dataclass
class ServerContext:
    """stream_hub: writes every streamed response. max_request_body_bytes: a larger body gets
    413 (None: no limit). engine: the EngineCore once loaded. loading: the model is loading.
    draining: new requests get 503 (a drain, or serving failed). failure: why serving failed
    for good (a tensor-parallel rank died), else None. openapi_json: the document, built on
    first request. metrics_registry / metrics_engine: /metrics' prometheus-client registry
    and the engine whose collector it holds."""

    stream_hub: StreamHub
    max_request_body_bytes: int | None = None
    engine: EngineCore | None = None
    loading: bool = False
    draining: bool = False
    failure: str | None = None
    openapi_json: bytes | None = None
    metrics_registry: Any = None
    metrics_engine: EngineCore | None = None

    def serving_engine(self) -> EngineCore:
        """The engine, for a route that needs the model. Raises ServerDrainingError (503) once
        the server drains and ModelLoadingError (503) while the model loads."""
        if self.draining:
            raise ServerDrainingError()
        if self.engine is None:
            raise ModelLoadingError()
        return self.engine


def context_of(request: Request) -> ServerContext:
    """The ServerContext of the app serving `request` (the innermost pyserve app where one is
    mounted in another)."""
    return cast(ServerContext, request.app.context)


def engine_of(request: Request) -> EngineCore:
    """`context_of(request).serving_engine()`: raises ModelLoadingError / ServerDrainingError."""
    return context_of(request).serving_engine()
