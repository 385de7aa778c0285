"""Graceful drain on SIGTERM / SIGINT (`pyserve serve`): new requests get 503, running ones may
finish for `--shutdown-timeout-s`, then the rest end: a stream with finish reason abort (its
last chunk says so, then `data: [DONE]`), a whole response with a 503 error object; the server
exits with status 0. A second signal, or a signal while the model loads, ends the process at
once: one line on stderr, status 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM),
as a shell reports a process a signal ended."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import uvicorn

if TYPE_CHECKING:  # (the CLI imports this module before its checks, which run without torch)
    from pyserve.server.context import ServerContext

logger = logging.getLogger(__name__)


async def drain(ctx: ServerContext, timeout_s: float) -> None:
    """Stop taking requests (the routes answer 503 ServerDrainingError, /health 503
    {"status": "draining"}) and drain the engine (EngineCore.drain). Loop thread."""
    ctx.draining = True
    engine = ctx.engine
    if engine is None:  # still loading: nothing runs
        return
    await engine.drain(timeout_s)
    await asyncio.sleep(0.1)  # the streams' last chunks and [DONE] go out on this loop


def exit_now(sig: int, why: str) -> NoReturn:
    """End the process at once with status 128 + `sig`, after the line `pyserve: {why},
    exiting now` on stderr. Nothing else runs: no drain, no thread is waited for (a model
    load cannot be stopped from another thread; the kernel closes the listening socket and
    the connections; tensor-parallel ranks end with their parent). Main thread (a signal
    handler)."""
    with contextlib.suppress(Exception):
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), f"pyserve: {why}, exiting now\n".encode())
    os._exit(128 + sig)


def signal_text(sig: int) -> str:
    """'interrupt' for SIGINT (Ctrl-C), else the signal's name."""
    if sig == signal.SIGINT:
        return "interrupt"
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


@contextlib.contextmanager
def signals_exit_now(what: str) -> Iterator[None]:
    """While the block runs, SIGINT / SIGTERM end the process at once (`exit_now`, the line
    naming `what`, e.g. "while downloading the model"). For work a KeyboardInterrupt cannot
    stop promptly: huggingface_hub's downloads run in a thread pool whose `with` block waits
    for the files in flight before the interrupt surfaces. Main thread; the previous handlers
    come back after the block."""
    previous = {
        sig: signal.signal(sig, lambda s, _frame: exit_now(s, f"{signal_text(s)} {what}"))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server whose first SIGTERM / SIGINT drains the app of `ctx` (see `drain`) before the
    usual shutdown, and whose second one ends the process at once (`exit_now`), as does one
    while the model loads (`ctx.loading`: the load runs on a thread nothing can stop).
    The signal is not raised again after the server stops (uvicorn's default), so a drained
    server exits with status 0."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext, timeout_s: float) -> None:
        super().__init__(config)
        self._ctx = ctx
        self._timeout_s = timeout_s
        self._drain_requested = False
        self._drain_task: asyncio.Future[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a signal handler: only flags here (or the exit); the drain starts on the loop (on_tick)
        if self._drain_requested:
            exit_now(sig, f"second {signal_text(sig)}")
        if self._ctx.loading:
            exit_now(sig, f"{signal_text(sig)} while the model loads")
        self._drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        logger.info(
            "shutting down: running requests may finish for up to %g s (--shutdown-timeout-s); "
            "a second Ctrl-C exits now",
            self._timeout_s,
        )
        try:
            await drain(self._ctx, self._timeout_s)
        except Exception:
            logger.exception("drain failed; shutting down")
        finally:
            self.should_exit = True
