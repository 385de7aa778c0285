"""`ModelWorker`: the one thread that touches the model, the KV tensors and the device stream.

The loop thread calls `submit(forward_batch)` and awaits the returned future; the worker runs
`ModelRunner.forward` + `step_output`, copies the next token ids (and logprobs) to the host and resolves the future
on the loop with `call_soon_threadsafe`. The worker never awaits the loop, and the loop never
blocks on the device (DESIGN.md section 1).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

import torch

from pyserve.model_executor.forward_batch import ForwardBatch, StepOutput

logger = logging.getLogger(__name__)

_STOP = object()


class ModelWorker:
    """Runs forward passes of `model_runner` on a dedicated thread (and CUDA stream on CUDA)."""

    def __init__(self, model_runner: Any) -> None:
        self.model_runner = model_runner
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pyserve-worker", daemon=True)
        self._thread.start()

    def submit(self, batch: ForwardBatch) -> asyncio.Future:
        """Queue one step. The future resolves to a StepOutput (next token ids, logprobs), or
        to the exception the step raised. Loop thread only."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((batch, loop, future))
        return future

    def shutdown(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        runner = self.model_runner
        stream = torch.cuda.Stream() if runner.device.startswith("cuda") else None
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch, loop, future = item
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        next_ids = self._step(batch)
                else:
                    next_ids = self._step(batch)
                result: Any = next_ids
                ok = True
            # A failed step fails its requests, not the server. BaseException: a panic in a
            # native kernel arrives as pyo3's PanicException, which is not an Exception, and
            # must not end this thread (the loop would wait forever on the step's future).
            except BaseException as exc:
                logger.exception("forward step failed")
                # the loop handles Exceptions; a panic is passed on as one
                result = exc if isinstance(exc, Exception) else RuntimeError(f"{type(exc).__name__}: {exc}")
                ok = False
            loop.call_soon_threadsafe(_resolve, future, ok, result)

    def _step(self, batch: ForwardBatch) -> StepOutput:
        runner = self.model_runner
        logits = runner.forward(batch)
        return runner.step_output(logits, batch)


def _resolve(future: asyncio.Future, ok: bool, result: Any) -> None:
    if future.cancelled():
        return
    if ok:
        future.set_result(result)
    else:
        future.set_exception(result)
