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
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from pyserve.config import ServerArgs, setup_logging
from pyserve.engine.engine_core import EngineCore
from pyserve.model_executor.runner_protocol import Runner
from pyserve.server import expert_routes, metrics, native, openapi, parse_routes, playground, tokenize
from pyserve.server.access_log import AccessLogMiddleware
from pyserve.server.auth import ApiKeyMiddleware
from pyserve.server.context import ServerContext
from pyserve.server.drain import drain
from pyserve.server.errors import EXCEPTION_HANDLERS
from pyserve.server.openai import embeddings, responses, serving
from pyserve.server.stream_hub import StreamHub

logger = logging.getLogger(__name__)


def create_app(
    server_args: ServerArgs | None = None,
    model_runner: Runner | None = None,
    *,
    load_in_background: bool = False,
    on_load_error: Callable[[BaseException], None] | None = None,
    on_failure: Callable[[str], None] | None = None,
    on_ready: Callable[[EngineCore], None] | None = None,
) -> PyserveApp:
    """The pyserve ASGI app. The model loads when the app's lifespan starts (ASGI lifespan
    protocol), on the server's event loop, and the engine stops when the lifespan ends.
    `app.context` is the app's ServerContext (server/context.py): `.engine` the EngineCore
    (None until loaded), `.stream_hub` the StreamHub every streamed response goes through
    (replace it before the start to choose its writers). model_runner: see EngineCore
    (benchmarks).

    load_in_background: the lifespan's start returns at once and the model loads in a task,
    so the server answers meanwhile: `/health` 503 {"status": "loading"}, every route that
    needs the model 503 (ModelLoadingError); a failed load is logged and passed to
    `on_load_error` (`pyserve serve` then exits 1). False (the default, for embedding): the
    start returns once the model is loaded, and a failed load fails the start.
    `on_ready(engine)` is called on the loop once the model serves (`pyserve serve` logs its
    ready line); `app.context.loading` is True while the model loads.

    When serving fails for good (a tensor-parallel rank died: EngineCore.on_failure) the
    routes answer 503, `/health` 503 {"status": "failed", "message": ...}, and
    `on_failure(message)` is called (`pyserve serve` then stops and exits 1).

    With `server_args.api_key` (or PYSERVE_API_KEY) every route but /health*, /metrics, the
    browser pages (pyserve.server.playground) and OPTIONS answers 401 without
    `Authorization: Bearer <key>` (pyserve.server.auth). A body over `max_request_body_bytes`
    gets 413 (server/errors.parse_json); `allowed_origins` turns on CORS; `enable_metrics`
    serves /metrics (server/metrics.py).

    Every HTTP request gets one access-log line at its end (server/access_log.py) unless
    `disable_log_requests`; an exception behind a 500 that went out whole is not raised on to
    the ASGI server (its traceback was logged once, by errors.handle_internal_error)."""
    args = server_args or ServerArgs()
    ctx = ServerContext(
        StreamHub(max_buffer_bytes=args.max_stream_buffer_bytes, stall_timeout_s=args.stream_stall_timeout_s),
        max_request_body_bytes=args.max_request_body_bytes,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        setup_logging(args.log_level)  # (a no-op where the program configured logging)
        engine = EngineCore(args, model_runner=model_runner)
        ctx.engine = None
        hub = ctx.stream_hub

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
            finally:
                ctx.loading = False
            ctx.engine = engine
            if on_ready is not None:
                on_ready(engine)

            def failed(message: str) -> None:
                ctx.draining = True
                ctx.failure = message
                if on_failure is not None:
                    on_failure(message)

            engine.on_failure(failed)

        ctx.loading = True
        loading = asyncio.ensure_future(load())
        if not load_in_background:
            await loading
        try:
            yield
        finally:
            if not loading.done():  # shut down while loading: the load (a thread) ends first
                await asyncio.wait([loading])
            if ctx.engine is not None:
                # under any ASGI server: what still runs when the lifespan ends drains as on
                # SIGTERM (after `pyserve serve`'s own drain there is nothing left)
                await drain(ctx, args.shutdown_timeout_s)
            hub.close()
            if ctx.engine is not None:
                await engine.shutdown()

    app = PyserveApp(
        routes=native.ROUTES
        + parse_routes.ROUTES
        + serving.ROUTES
        + embeddings.ROUTES
        + responses.ROUTES
        + tokenize.ROUTES
        + expert_routes.ROUTES
        + openapi.ROUTES
        + playground.ROUTES,
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=_middleware(args),
    )
    app.context = ctx
    app.log_requests = not args.disable_log_requests
    if args.enable_metrics:
        app.router.routes.extend(metrics.ROUTES)
    return app


class PyserveApp(Starlette):
    """Starlette with the access log (AccessLogMiddleware) outside all of its middleware,
    Starlette's ServerErrorMiddleware included, so it sees every response's status."""

    log_requests = True  # write the access lines (False: --disable-log-requests)
    context: ServerContext  # what the routes share (set by create_app)

    def build_middleware_stack(self) -> ASGIApp:
        return AccessLogMiddleware(super().build_middleware_stack(), self.log_requests)


def _middleware(args: ServerArgs) -> list[Middleware]:
    """Outermost first: CORS (so a browser also reads the 401 answers), the API key check.
    Both pass `receive` and `send` through untouched (the streams' socket writer needs
    uvicorn's own)."""
    middleware = []
    if args.allowed_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=args.allowed_origins,
                allow_methods=args.allowed_methods,
                allow_headers=args.allowed_headers,
                allow_credentials=args.allow_credentials,
            )
        )
    api_key = args.api_key or os.environ.get("PYSERVE_API_KEY") or None
    if api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=api_key))
    return middleware
