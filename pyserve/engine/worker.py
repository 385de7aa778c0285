"""`ModelWorker`: the one thread that touches the model, the device tensors and the device stream.

The loop thread calls `submit(plan)` with a host-only `StepPlan` and gets a future; steps run in
submission order. For each, the worker applies the plan to its `DeviceState` (request rows,
token table, sampling rows), runs `ModelRunner.forward`, samples, writes the new tokens into
the token table (the next decode step reads them there), copies the ids (and logprobs) to the
host and resolves the future on the loop with `call_soon_threadsafe` (then calls the
submitter's `done` hook in the same callback). Because the queue keeps order, the loop may
submit step N+1 before step N's future resolved (overlap scheduling). The worker never awaits
the loop, and the loop never blocks on the device (DESIGN.md section 1); with an asynchronous
runner it waits, in `submit`, for the worker's host-side launch of the step (see `submit`).

A runner whose launches are asynchronous does not make the worker wait: a second thread, the
completer, waits for each step's end in order and resolves its future, while the worker
already builds and launches the next step, so its host work overlaps the device's. On CUDA
the step's ids and failed-row mask are copied into pinned host memory without blocking and
the completer waits on an event recorded after the copy; the simulated device gives its own
`step_done_waiter`. A CPU runner computes synchronously: the worker resolves each step itself,
as it does for an embedding runner (`is_embedding`), whose steps are pooled embeddings copied
to the host (`embed`) and never sample.

With tensor parallelism (a runner with a `tp` group) this worker is rank 0's: before each
step it broadcasts the plan (without its sampling rows, which only rank 0 holds) to the other
ranks, which apply it to their own tables and run the same forward on their shards
(`pyserve.engine.rank_main`); after sampling it broadcasts the step's ids, which the
ranks write into their token tables, the inputs of the next decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pyserve.distributed.group import RankLostError, RankOutOfStepError, TensorParallelGroup
from pyserve.distributed.messages import STOP_RANKS, RankStart, rank_plan
from pyserve.forward_batch_info import StepOutput, StepPlan
from pyserve.model_executor.device_state import DeviceState
from pyserve.model_executor.runner_protocol import Runner

logger = logging.getLogger(__name__)

_STOP = object()

# how long `submit` waits for the worker to launch the step (seconds); a launch takes ~0.1 ms
LAUNCH_WAIT_S = 0.005


class ModelWorker:
    """Runs the steps of `model_runner` on a dedicated thread (and CUDA stream on CUDA).

    num_rows / row_width: the request rows of the KV core (`KVCache.num_rows` and its
    maximum context) that the device tables mirror; vocab_size: the model's.
    """

    def __init__(self, model_runner: Runner, num_rows: int, row_width: int, vocab_size: int) -> None:
        self.model_runner = model_runner
        self.state = DeviceState(num_rows, row_width, vocab_size, model_runner.device)
        self._tp: TensorParallelGroup | None = model_runner.tp
        self._rank_lost: RankLostError | None = None  # the group broke: every later step fails
        # told (from this thread) when rank 0 itself put the ranks out of step, which no
        # rank's death reports: EngineCore fails the server
        self.on_fatal: Callable[[str], None] | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # plans (C queue: no Python lock per put)
        self._cuda = str(model_runner.device).startswith("cuda")
        info = model_runner.info
        # a CPU runner whose launches are asynchronous (SimulatedRunner) says how to wait for a step
        self._step_done_waiter: Callable[[], Callable[[], None]] | None = (
            model_runner.step_done_waiter if info.async_launch else None
        )
        # an embedding runner computes pooled embeddings instead
        self._embed: Callable[[Any], torch.Tensor] | None = model_runner.embed if info.embedding is not None else None
        self._async = (self._cuda or self._step_done_waiter is not None) and self._embed is None
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self._launches: queue.SimpleQueue = queue.SimpleQueue()  # numbers of launched steps
        self._num_submitted = 0
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pyserve-worker", daemon=True)
        self._thread.start()
        self._ready.wait()  # CUDA graphs are captured on the worker's thread and stream first
        if self._start_error is not None:
            raise self._start_error
        if self._async:
            threading.Thread(target=self._complete, name="pyserve-completer", daemon=True).start()

    @property
    def num_live_sampling_rows(self) -> int:
        """Requests whose sampling rows the worker holds (0 once idle: the leak check)."""
        return self.state.sampling.num_live

    @property
    def num_live_grammar_rows(self) -> int:
        """Requests whose grammar matchers the worker holds (0 once idle: the leak check)."""
        return self.state.grammar.num_live

    def submit(self, plan: StepPlan, done: Callable[[asyncio.Future], None] | None = None) -> asyncio.Future:
        """Queue one step. The future resolves to a StepOutput (next token ids, logprobs), or
        to the exception the step raised; `done(future)` is then called at once, in the same
        loop callback (not scheduled behind the loop's other ready callbacks, as a future's
        own callbacks are). Loop thread only.

        With an asynchronous runner this returns once the worker has launched the step
        (at most LAUNCH_WAIT_S): while the worker turns the plan into device work, the loop
        holds back, so the worker's many short GIL releases (every torch call) are not each
        followed by a wait for the loop to give the GIL back, which made launches late by
        milliseconds (DESIGN.md section 1)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._num_submitted += 1
        self._queue.put((plan, loop, future, done))
        if self._async:
            deadline = time.monotonic() + LAUNCH_WAIT_S
            with contextlib.suppress(queue.Empty):  # late: go on, the step still runs
                while self._launches.get(timeout=max(deadline - time.monotonic(), 0.0)) < self._num_submitted:
                    pass  # a step whose launch an earlier submit stopped waiting for
        return future

    def release_rows(self, rows: list[int]) -> None:
        """Drop the sampling rows of requests that left while no step follows (the next plan
        carries later releases itself). Loop thread only; ordered with the steps."""
        self._queue.put((rows, None, None, None))

    def shutdown(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30)
        self._done.put(_STOP)
        # A broken group gets no stop: a rank out of step would take it for a step's
        # collective and both would wait; RankProcesses.stop ends those ranks instead.
        if self._tp is not None and self._rank_lost is None:
            with contextlib.suppress(RankLostError):  # a rank that died since
                self._tp.send_object(STOP_RANKS)

    def _complete(self) -> None:
        while True:
            item = self._done.get()
            if item is _STOP:
                return
            wait, loop, future, done, ok, result = item
            if wait is not None:
                try:
                    wait()
                except BaseException as exc:  # an asynchronous device fault surfaces here
                    logger.exception("forward step failed on the device")
                    ok, result = False, exc if isinstance(exc, Exception) else RuntimeError(str(exc))
            loop.call_soon_threadsafe(_resolve, future, done, ok, result)

    def _run(self) -> None:
        runner = self.model_runner
        stream = None
        if runner.device.startswith("cuda"):
            device = torch.device(runner.device)
            if device.index is None:  # set_device refuses a bare "cuda": name the current one
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device=device)
            # the pool, tables and graph buffers were made on the default stream: finish
            # that before the worker's stream touches them
            torch.cuda.synchronize(device)
        try:
            if self._tp is not None:  # the ranks build their tables (and graphs) alike
                num_rows, row_width = self.state.req_to_token.shape
                vocab = self.state.sampling.vocab_size
                self._tp.send_object(RankStart(num_rows, row_width, vocab, capture_graphs=stream is not None))
            if stream is not None:
                runner.init_cuda_graphs(self.state.req_to_token, stream)
        except BaseException as exc:  # the constructor raises it on the caller's thread
            self._start_error = exc
            return
        finally:
            self._ready.set()
        with torch.inference_mode():  # thread-local: once for every step (not a switch each)
            self._serve(runner, stream)

    def _serve(self, runner: Runner, stream: torch.cuda.Stream | None) -> None:
        num_launched = 0
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            plan, loop, future, done = item
            result: StepOutput | Exception
            if future is None:  # a release without a step
                self.state.grammar.flush()
                self.state.release_rows(plan)
                continue
            try:
                if self._rank_lost is not None:
                    raise self._rank_lost
                if stream is not None:
                    with torch.cuda.stream(stream):
                        result, wait = self._step(plan)
                else:
                    result, wait = self._step(plan)
                ok = True
            # A failed step fails its requests, not the server. BaseException: a panic in a
            # native kernel arrives as pyo3's PanicException, which is not an Exception, and
            # must not end this thread (the loop would wait forever on the step's future).
            except RankLostError as exc:  # one line, once: the launcher names the rank
                if self._rank_lost is None:
                    logger.error("forward step failed: %s", exc)
                    if isinstance(exc, RankOutOfStepError) and self.on_fatal is not None:
                        self.on_fatal(str(exc))
                self._rank_lost = exc
                result, ok = exc, False
            except BaseException as exc:
                logger.exception("forward step failed")
                # the loop handles Exceptions; a panic is passed on as one
                result = exc if isinstance(exc, Exception) else RuntimeError(f"{type(exc).__name__}: {exc}")
                ok = False
            if self._async:  # resolved, in order, once the device has run the step
                num_launched += 1
                self._launches.put(num_launched)
                self._done.put((wait if ok else None, loop, future, done, ok, result))
            else:
                loop.call_soon_threadsafe(_resolve, future, done, ok, result)

    def _step(self, plan: StepPlan) -> tuple[StepOutput, Any]:
        """Run one step (in inference mode: `_run` holds it for the thread); returns its
        output and, for an asynchronous runner, the function that waits until the output is
        on the host (None for a CPU runner: it already is)."""
        runner = self.model_runner
        tp = self._tp
        # Rank 0's tables and rows first: a plan refused here (it raises before any table is
        # written) never reaches the other ranks, so every plan they get is run by all.
        batch = self.state.forward_batch(plan)
        if tp is not None:  # the same plan, minus the sampling rows only rank 0 holds
            tp.send_object(rank_plan(plan))
        if self._embed is not None:  # an embedding server: pooled hidden states, no sampling
            embeddings = self._embed(batch).cpu().numpy()
            zeros = np.zeros(batch.batch_size, dtype=np.int32)
            return StepOutput(next_token_ids=zeros, embeddings=embeddings), None
        try:
            logits = runner.forward(batch)
        except RankLostError:
            raise
        except BaseException as exc:
            if tp is not None:  # the ranks ran this forward's collectives: out of step for good
                raise RankOutOfStepError(f"rank 0's forward failed: {type(exc).__name__}: {exc}") from exc
            raise
        grammar = self.state.grammar
        try:
            if grammar.num_live:  # after the launch: only sampling waits for the matchers
                assert batch.sampling_info is not None
                grammar.prepare(batch.sampling_info, plan.req_pool_indices)
            next_ids, failed = runner.sample_next(logits, batch)
            ids = self.state.record_sampled(plan, batch, next_ids)  # [B] int32, what the host gets
        except BaseException:
            if tp is not None:  # the ranks wait for this step's ids: placeholders
                tp.broadcast(torch.zeros(batch.batch_size, dtype=torch.int32, device=runner.device))
            raise
        if tp is not None:
            tp.broadcast(ids)
        if not self._cuda:
            if grammar.num_live:
                grammar.record(ids.numpy())
            failed_np = failed.numpy()
            out = StepOutput(
                next_token_ids=ids.numpy(), failed_rows=np.flatnonzero(failed_np).tolist() if failed_np.any() else []
            )
            runner.add_logprobs(out, logits, batch, next_ids)
            return out, (self._step_done_waiter() if self._step_done_waiter is not None else None)
        ids_host = torch.empty(next_ids.shape, dtype=torch.int32, pin_memory=True)
        ids_host.copy_(ids, non_blocking=True)
        failed_host = torch.empty(failed.shape, dtype=torch.bool, pin_memory=True)
        failed_host.copy_(failed, non_blocking=True)
        copied = torch.cuda.Event(blocking=True)  # the completer sleeps, not spins, on it
        copied.record()
        out = StepOutput(next_token_ids=ids_host.numpy())
        runner.add_logprobs(out, logits, batch, next_ids)
        if grammar.num_live:  # the matchers take these ids before the next step samples
            grammar.record(out.next_token_ids, copied.synchronize)

        def wait() -> None:  # completer thread: the copies landed, then the failed rows
            copied.synchronize()
            out.failed_rows = np.flatnonzero(failed_host.numpy()).tolist()

        return out, wait


def _resolve(future: asyncio.Future, done: Callable[[asyncio.Future], None] | None, ok: bool, result: Any) -> None:
    if future.cancelled():
        return
    if ok:
        future.set_result(result)
    else:
        future.set_exception(result)
    if done is not None:
        done(future)
