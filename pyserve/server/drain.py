"""Graceful drain on SIGTERM / SIGINT (`pyserve serve`): new requests get 503, running ones may
finish for `--shutdown-timeout-s`, then the rest end: a stream with finish reason abort (its
last chunk says so, then `data: [DONE]`), a whole response with a 503 error object; the server
exits with status 0. A second signal exits at once."""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn
from starlette.applications import Starlette

logger = logging.getLogger(__name__)


async def drain(app: Starlette, timeout_s: float) -> None:
    """Stop taking requests (the routes answer 503 ServerDrainingError, /health 503
    {"status": "draining"}) and drain the engine (EngineCore.drain). Loop thread."""
    app.state.draining = True
    engine = getattr(app.state, "engine", None)
    if engine is None:  # still loading: nothing runs
        return
    await engine.drain(timeout_s)
    await asyncio.sleep(0.1)  # the streams' last chunks and [DONE] go out on this loop


class DrainingServer(uvicorn.Server):
    """uvicorn's Server whose first SIGTERM / SIGINT drains `app` (see `drain`) before the
    usual shutdown, and whose second one exits at once. The signal is not raised again after
    the server stops (uvicorn's default), so a drained server exits with status 0."""

    def __init__(self, config: uvicorn.Config, app: Starlette, timeout_s: float) -> None:
        super().__init__(config)
        self._app = app
        self._timeout_s = timeout_s
        self._drain_requested = False
        self._drain_task: asyncio.Future[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a signal handler: only flags here; the drain starts on the loop (on_tick)
        if self._drain_requested:
            self.force_exit = True
            self.should_exit = True
        self._drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        try:
            await drain(self._app, self._timeout_s)
        except Exception:
            logger.exception("drain failed; shutting down")
        finally:
            self.should_exit = True
