"""`ModelWorker`: the one thread that touches the model, the device tensors and the device stream.

The loop thread calls `submit(plan)` with a host-only `StepPlan` and gets a future; steps run in
submission order. For each, the worker applies the plan to its `DeviceState` (request rows,
token table, sampling rows), runs `ModelRunner.forward`, samples, writes the new tokens into
the token table (the next decode step reads them there), copies the ids (and logprobs) to the
host and resolves the future on the loop with `call_soon_threadsafe`. Because the queue keeps
order, the loop may submit step N+1 before step N's future resolved (overlap scheduling). The
worker never awaits the loop, and the loop never blocks on the device (DESIGN.md section 1).

A runner whose launches are asynchronous (it has `step_done_waiter`, as the simulated device
does and a CUDA runner with copy-done events will) does not make the worker wait: a second
thread, the completer, waits for each step's end in order and resolves its future, while the
worker already builds and launches the next step, so its host work overlaps the device's.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

import torch

from pyserve.forward_batch_info import StepOutput, StepPlan
from pyserve.model_executor.device_state import DeviceState

logger = logging.getLogger(__name__)

_STOP = object()


class ModelWorker:
    """Runs the steps of `model_runner` on a dedicated thread (and CUDA stream on CUDA).

    num_rows / row_width: the request rows of the KV core (`KVCache.num_rows` and its
    maximum context) that the device tables mirror; vocab_size: the model's.
    """

    def __init__(self, model_runner: Any, num_rows: int, row_width: int, vocab_size: int) -> None:
        self.model_runner = model_runner
        self.state = DeviceState(num_rows, row_width, vocab_size, model_runner.device)
        self._queue: queue.Queue = queue.Queue()
        self._async = hasattr(model_runner, "step_done_waiter")
        self._done: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pyserve-worker", daemon=True)
        self._thread.start()
        if self._async:
            threading.Thread(target=self._complete, name="pyserve-completer", daemon=True).start()

    @property
    def num_live_sampling_rows(self) -> int:
        """Requests whose sampling rows the worker holds (0 once idle: the leak check)."""
        return self.state.sampling.num_live

    def submit(self, plan: StepPlan) -> asyncio.Future:
        """Queue one step. The future resolves to a StepOutput (next token ids, logprobs), or
        to the exception the step raised. Loop thread only."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((plan, loop, future))
        return future

    def release_rows(self, rows: list[int]) -> None:
        """Drop the sampling rows of requests that left while no step follows (the next plan
        carries later releases itself). Loop thread only; ordered with the steps."""
        self._queue.put((rows, None, None))

    def shutdown(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30)
        self._done.put(_STOP)

    def _complete(self) -> None:
        while True:
            item = self._done.get()
            if item is _STOP:
                return
            wait, loop, future, ok, result = item
            if wait is not None:
                wait()
            loop.call_soon_threadsafe(_resolve, future, ok, result)

    def _run(self) -> None:
        runner = self.model_runner
        stream = torch.cuda.Stream() if runner.device.startswith("cuda") else None
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            plan, loop, future = item
            if future is None:  # a release without a step
                self.state.sampling.release_rows(plan)
                continue
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        result: Any = self._step(plan)
                else:
                    result = self._step(plan)
                ok = True
            # A failed step fails its requests, not the server. BaseException: a panic in a
            # native kernel arrives as pyo3's PanicException, which is not an Exception, and
            # must not end this thread (the loop would wait forever on the step's future).
            except BaseException as exc:
                logger.exception("forward step failed")
                # the loop handles Exceptions; a panic is passed on as one
                result = exc if isinstance(exc, Exception) else RuntimeError(f"{type(exc).__name__}: {exc}")
                ok = False
            if self._async:  # resolved, in order, once the device has run the step
                self._done.put((runner.step_done_waiter() if ok else None, loop, future, ok, result))
            else:
                loop.call_soon_threadsafe(_resolve, future, ok, result)

    def _step(self, plan: StepPlan) -> StepOutput:
        runner = self.model_runner
        with torch.inference_mode():
            batch = self.state.forward_batch(plan)
            logits = runner.forward(batch)
            next_ids, failed_rows = runner.sample_next(logits, batch)
            self.state.record_sampled(plan, batch, next_ids)
            out = StepOutput(next_token_ids=next_ids.to(torch.int32).cpu().numpy(), failed_rows=failed_rows)
            runner.add_logprobs(out, logits, batch, next_ids)
        return out


def _resolve(future: asyncio.Future, ok: bool, result: Any) -> None:
    if future.cancelled():
        return
    if ok:
        future.set_result(result)
    else:
        future.set_exception(result)
