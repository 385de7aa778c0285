"""`create_app(server_args)`: the Starlette app; its lifespan starts and stops the engine, so
the app can be mounted in any ASGI server (uvicorn, hypercorn, or inside another app)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette

from pyserve.config import ServerArgs
from pyserve.engine.engine_core import EngineCore
from pyserve.model_executor.runner_protocol import Runner
from pyserve.server import native
from pyserve.server.errors import EXCEPTION_HANDLERS
from pyserve.server.openai import serving
from pyserve.server.stream_hub import StreamHub


def create_app(server_args: ServerArgs | None = None, model_runner: Runner | None = None) -> Starlette:
    """The pyserve ASGI app. The model loads when the app's lifespan starts (ASGI lifespan
    protocol), on the server's event loop, and the engine stops when the lifespan ends.
    `app.state.engine` is the EngineCore; `app.state.stream_hub` the StreamHub every streamed
    response goes through (set one before the start to choose its writers). model_runner: see
    EngineCore (benchmarks)."""
    args = server_args or ServerArgs()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine = EngineCore(args, model_runner=model_runner)
        await engine.start()
        app.state.engine = engine
        hub = getattr(app.state, "stream_hub", None)
        if hub is None:
            hub = app.state.stream_hub = StreamHub()
        try:
            yield
        finally:
            hub.close()
            await engine.shutdown()

    return Starlette(routes=native.ROUTES + serving.ROUTES, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
