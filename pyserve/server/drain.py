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

SHUTDOWN_MESSAGE = "server shutting down"
_SETTLE_S = 5.0  # how long ended requests get to hand their last outputs to their streams


async def drain(app: Starlette, timeout_s: float) -> None:
    """Stop taking requests (the routes answer 503 ServerDrainingError, /health 503
    {"status": "draining"}), wait up to `timeout_s` for the running ones, then end the rest
    (TokenizerManager.end_all_for_shutdown) and wait (up to _SETTLE_S) until their consumers
    have their last output.
    Loop thread."""
    app.state.draining = True
    engine = getattr(app.state, "engine", None)
    if engine is None:  # still loading: nothing runs
        return
    states = engine.tokenizer_manager.states
    loop = asyncio.get_running_loop()
    logger.info("draining: %d requests running; new ones get 503 (a second signal exits at once)", len(states))
    deadline = loop.time() + timeout_s
    while states and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if states:
        ended = engine.tokenizer_manager.end_all_for_shutdown(SHUTDOWN_MESSAGE)
        logger.info("drain: %d requests still running after %g s are ended", ended, timeout_s)
        deadline = loop.time() + _SETTLE_S
        while states and loop.time() < deadline:
            await asyncio.sleep(0.05)
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
