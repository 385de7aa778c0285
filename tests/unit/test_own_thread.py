"""run_in_own_thread (pyserve/engine/own_thread.py): the function runs on a new thread that
then ends, its result or exception reaches the awaiting task."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pyserve.engine.own_thread import run_in_own_thread


def _raise(exc: BaseException) -> None:
    raise exc


def test_result_exceptions_and_the_thread_ends() -> None:
    async def main() -> None:
        thread = await run_in_own_thread(threading.current_thread)
        assert thread is not threading.current_thread() and thread.name == "pyserve-load"
        thread.join(timeout=5)
        assert not thread.is_alive()
        assert await run_in_own_thread(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ValueError, match="bad input"):
            await run_in_own_thread(_raise, ValueError("bad input"))
        # a future cannot carry StopIteration: it arrives as a RuntimeError, not a hang
        with pytest.raises(RuntimeError, match="StopIteration"):
            await asyncio.wait_for(run_in_own_thread(_raise, StopIteration()), timeout=5)

    asyncio.run(main())


def test_a_cancelled_wait_leaves_the_thread_to_finish() -> None:
    release = threading.Event()
    finished = threading.Event()

    def slow() -> int:
        release.wait(5)
        finished.set()
        return 1

    async def main() -> None:
        task = asyncio.ensure_future(run_in_own_thread(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())  # the loop is closed before the thread settles
    release.set()
    assert finished.wait(5)
