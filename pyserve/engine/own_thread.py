"""Running start-up work on a thread of its own that ends with it.

Why not the event loop's default executor: libgomp (torch's OpenMP runtime) keeps a team of
threads for every thread that ever ran a parallel torch op, for as long as that thread lives.
Loading the model on an executor thread left such a team beside the worker thread's; libgomp
then counts more threads than cores and no longer spins between parallel regions (its
"throttled" wait, GOMP_SPINCOUNT's 100-iteration default) but sleeps on a futex: every parallel
region of a step started with a wake-up, about 150 context switches and ~2 ms of a
SmolLM2-135M decode step on the 2-core test machine. A thread that ends frees its team.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def run_in_own_thread(fn: Callable[..., T], *args: Any, name: str = "pyserve-load") -> T:
    """fn(*args) on a new thread, awaited on the running loop; returns its result or raises
    what it raised. The thread ends when fn returns (it is a daemon: a cancelled await leaves
    it to finish alone)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if done.done():  # the awaiting task was cancelled
            return
        if ok:
            done.set_result(value)
        elif isinstance(value, StopIteration):  # a future refuses it as an exception
            done.set_exception(RuntimeError(f"{fn!r} raised StopIteration"))
        else:
            done.set_exception(value)

    def run() -> None:
        outcome: tuple[bool, Any]
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            outcome = (False, exc)
        # a loop closed meanwhile (start-up was cancelled) raises RuntimeError: nobody waits
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done
