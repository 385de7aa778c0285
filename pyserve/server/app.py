"""`create_app(server_args)`: the Starlette app; its lifespan starts and stops the engine, so
the app can be mounted in any ASGI server (uvicorn, hypercorn, or inside another app)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware

from pyserve.config import ServerArgs
from pyserve.engine.engine_core import EngineCore
from pyserve.model_executor.runner_protocol import Runner
from pyserve.server import native, tokenize
from pyserve.server.auth import ApiKeyMiddleware
from pyserve.server.errors import EXCEPTION_HANDLERS
from pyserve.server.openai import serving
from pyserve.server.stream_hub import StreamHub

logger = logging.getLogger(__name__)


def create_app(
    server_args: ServerArgs | None = None,
    model_runner: Runner | None = None,
    *,
    load_in_background: bool = False,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> Starlette:
    """The pyserve ASGI app. The model loads when the app's lifespan starts (ASGI lifespan
    protocol), on the server's event loop, and the engine stops when the lifespan ends.
    `app.state.engine` is the EngineCore (None until loaded); `app.state.stream_hub` the
    StreamHub every streamed response goes through (set one before the start to choose its
    writers). model_runner: see EngineCore (benchmarks).

    load_in_background: the lifespan's start returns at once and the model loads in a task,
    so the server answers meanwhile: `/health` 503 {"status": "loading"}, every route that
    needs the model 503 (ModelLoadingError); a failed load is logged and passed to
    `on_load_error` (`pyserve serve` then exits 1). False (the default, for embedding): the
    start returns once the model is loaded, and a failed load fails the start.

    With `server_args.api_key` (or PYSERVE_API_KEY) every route but /health* and OPTIONS
    answers 401 without `Authorization: Bearer <key>` (pyserve.server.auth)."""
    args = server_args or ServerArgs()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine = EngineCore(args, model_runner=model_runner)
        app.state.engine = None
        if getattr(app.state, "stream_hub", None) is None:
            app.state.stream_hub = StreamHub()
        hub: StreamHub = app.state.stream_hub

        async def load() -> None:
            try:
                await engine.start()
            except Exception as exc:
                if not load_in_background:
                    raise
                logger.exception("the model failed to load")
                if on_load_error is not None:
                    on_load_error(exc)
                return
            app.state.engine = engine

        loading = asyncio.ensure_future(load())
        if not load_in_background:
            await loading
        try:
            yield
        finally:
            hub.close()
            if not loading.done():  # shut down while loading: the load (a thread) ends first
                await asyncio.wait([loading])
            if app.state.engine is not None:
                await engine.shutdown()

    api_key = args.api_key or os.environ.get("PYSERVE_API_KEY") or None
    middleware = [Middleware(ApiKeyMiddleware, api_key=api_key)] if api_key else []
    return Starlette(
        routes=native.ROUTES + serving.ROUTES + tokenize.ROUTES,
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=middleware,
    )
