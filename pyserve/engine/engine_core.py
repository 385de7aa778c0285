"""`EngineCore`: builds and runs the serving pipeline on the event loop it is started on.

Start-up (model load, KV pool sizing) runs in an executor so the loop stays responsive; then
the scheduler and detokenizer run as tasks on the same loop as the HTTP server. The HTTP app
(`create_app`) and the Python `Engine` both drive an EngineCore.

This module holds the lifecycle (load, start, drain, shutdown, a rank's failure), encode,
abort, flush and introspection. EngineCore inherits the rest: the request entry points and
their n > 1 / batch fan-out (fan_out.FanOutMixin, beside parallel_sampling.py) and the
tokenizer services (tokenizer_services.TokenizerServicesMixin: chat template, echo's prompt
text, model name resolution). Loop thread, except what `start` runs on its own threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pyserve.config import ServerArgs
from pyserve.constrained import GrammarBackend, JsonWhitespace, serving_grammar_backend
from pyserve.engine.detokenizer import Detokenizer
from pyserve.engine.embedding_inputs import check_embedding_inputs
from pyserve.engine.end_cause import end_error
from pyserve.engine.fan_out import FanOutMixin
from pyserve.engine.own_thread import run_in_own_thread
from pyserve.engine.scheduler import Scheduler
from pyserve.engine.scheduler_config import SchedulerConfig
from pyserve.engine.server_info import ServerInfoMixin
from pyserve.engine.tokenizer_manager import TokenizerManager
from pyserve.engine.tokenizer_services import TokenizerServicesMixin, default_name
from pyserve.engine.worker import ModelWorker
from pyserve.errors import InvalidRequestError
from pyserve.forward_batch_info import SHUTTING_DOWN_MESSAGE, EndCause, TokenOut
from pyserve.io_struct import GenerateOutput, SingleReq, new_rid
from pyserve.mem_cache.kv_cache import KVCache
from pyserve.metrics import RequestMetrics
from pyserve.model_executor.runner_protocol import EmbeddingInfo, Runner
from pyserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# how long shutdown waits for the steps in flight before it stops the scheduler anyway (s)
SHUTDOWN_DRAIN_S = 30.0
DRAIN_SETTLE_S = 5.0  # how long ended requests get to hand their last outputs to their consumers


class EngineCore(FanOutMixin, TokenizerServicesMixin, ServerInfoMixin):
    """The pipeline: TokenizerManager -> Scheduler -> ModelWorker -> Detokenizer, each
    made and owned here (the tokenizer manager only registers requests with the detokenizer).

    All methods run on the loop that called `start()`, except `start` work done in executors.
    """

    def __init__(self, server_args: ServerArgs, model_runner: Runner | None = None) -> None:
        """model_runner: serve with this ModelRunner-like object instead of loading the model
        (benchmarks run a SimulatedRunner; the tokenizer still comes from the model path)."""
        self.server_args = server_args
        self._given_runner = model_runner
        self.started = False
        self._tasks: list[asyncio.Task] = []
        self.grammar_backend: GrammarBackend | None = None
        # tensor parallelism: the other ranks' processes (None at --tp-size 1), the failure
        # that ended serving (a rank died) and who is told of it (`on_failure`)
        self.ranks: Any = None
        self.failure: str | None = None
        self._failure_listeners: list[Callable[[str], None]] = []
        # rid -> the rids running for it (a batch's prompts, n > 1 samples and their prefill)
        self._derived: dict[str, set[str]] = {}

    @property
    def embedding_info(self) -> EmbeddingInfo | None:
        """What the served model's embeddings are (pooling, size, matryoshka sizes); None for
        a model that generates. After start."""
        return self.model_runner.info.embedding

    async def start(self) -> None:
        """Load the tokenizer and model, size the KV pool, start the scheduler. Raises what
        loading raises (missing files, unsupported architecture), and RuntimeError when a
        tensor-parallel rank died before serving began."""
        # One rayon pool serves every batched tokenizers call in the process: a burst's
        # encode_batch on the executor thread spreads over every core and holds the pool
        # while any other batched call waits (a decode_batch on the loop waited up to 140 ms
        # at 256 clients). Single-threaded, the tokenizer thread takes one core and leaves
        # the loop its own. An explicit setting wins.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._loop = asyncio.get_running_loop()
        try:
            await self._start()
        except BaseException:
            # a failed start leaves nothing running: the worker thread and the other ranks
            worker = getattr(self, "worker", None)
            if self.ranks is not None:
                self.ranks.expect_end()
            if worker is not None:
                with contextlib.suppress(Exception):
                    worker.shutdown()
            if self.ranks is not None:
                self.ranks.stop()
            raise
        if self.failure is not None:  # a rank died while the rest started: serving never begins
            await self.shutdown()
            raise RuntimeError(self.failure)

    async def _start(self) -> None:
        loop = self._loop
        await run_in_own_thread(self._load)
        args = self.server_args
        runner = self.model_runner
        # an embedding server runs each prompt as one whole prefill step (never cut: an
        # encoder's tokens attend to all of their prompt) and generates nothing; an encoder
        # keeps no KV, so it has no prefix to reuse either, and a decoder only when it pools
        # the last token (mean or CLS pooling needs the hidden states of every token, which a
        # cached prefix does not recompute)
        embedding = runner.info.embedding
        self.is_generation = embedding is None
        no_prefix_reuse = runner.info.is_encoder or (embedding is not None and embedding.pooling.mode != "last")
        self.kv_cache = KVCache(
            runner.max_total_num_tokens,
            args.max_running_requests,
            self.context_len,
            disable_radix_cache=args.disable_radix_cache or no_prefix_reuse,
            page_size=args.page_size,
        )
        mc = runner.model_config
        # on CUDA the worker captures the decode graphs before it is ready: not on the loop
        self.worker = await run_in_own_thread(
            ModelWorker, runner, self.kv_cache.num_rows, self.kv_cache.max_context_len, mc.vocab_size
        )
        self.worker.on_fatal = lambda message: self._rank_died_threadsafe(0, message)
        self.grammar_backend = None  # --grammar-backend none, or an embedding server
        if args.grammar_backend != "none" and self.is_generation:
            self.grammar_backend = await loop.run_in_executor(
                None,
                serving_grammar_backend,
                args.grammar_backend,
                self.tokenizer,
                mc.vocab_size,
                mc.eos_token_ids,
                JsonWhitespace(
                    compact=args.constrained_json_disable_any_whitespace,
                    pattern=args.constrained_json_whitespace_pattern,
                ),
            )
        chunked = (
            args.resolved_chunked_prefill_size(_device_memory_bytes(str(runner.device))) if self.is_generation else None
        )
        self.scheduler = Scheduler(
            SchedulerConfig.from_server_args(args, self.context_len, chunked, runner.device),
            self.kv_cache,
            self.worker,
            emit=self._emit,
            grammar_backend=self.grammar_backend,
            metrics=RequestMetrics() if args.enable_metrics else None,
        )
        # the detokenizer hands each output to the tokenizer manager, which tracks the consumers
        self.detokenizer = Detokenizer(self.tokenizer, self._deliver, self.scheduler.end)
        self.tokenizer_manager = TokenizerManager(
            self.tokenizer,
            self.scheduler,
            self.detokenizer,
            self.context_len,
            runner.max_total_num_tokens,
            vocab_size=mc.vocab_size,
            eos_token_ids=frozenset(mc.eos_token_ids),
            stream_interval=args.stream_interval,
            max_queued_requests=args.max_queued_requests,
            abort_on_priority_when_disabled=args.abort_on_priority_when_disabled,
            is_generation=self.is_generation,
        )
        self._scheduler_task = asyncio.create_task(self.scheduler.run(), name="pyserve-scheduler")
        self._tasks = [
            self._scheduler_task,
            asyncio.create_task(self.detokenizer.run(), name="pyserve-detokenizer"),
        ]
        for task in self._tasks:
            task.add_done_callback(_log_task_death)
        self.started = True
        self.start_time = time.time()
        # What loading left (the tokenizer's vocabulary, the imported libraries: ~360k
        # objects) lives as long as the server. Frozen, the collector skips it: a full
        # collection of it stalls the loop (and the device) for 100-200 ms.
        gc.freeze()
        # Python's first threshold (700) is made for small programs: at 256 clients it ran
        # ~40 collections (generations 0 and 1) a second, 75 ms in a 3 s run, up to 11 ms
        # each, on the loop; at 50000, one of ~13 ms (docs/architecture.md)
        self._gc_threshold_before = gc.get_threshold()
        if self.server_args.gc_threshold is not None:
            gc.set_threshold(*self.server_args.gc_threshold)

    def _load(self) -> None:
        from pyserve.model_executor.model_runner import ModelRunner
        from pyserve.model_loader.default_model import default_model_path
        from pyserve.model_loader.hub import resolve_hub_paths
        from pyserve.model_loader.model_path import check_model_path
        from pyserve.model_loader.tokenizer import get_tokenizer, set_chat_template

        # Hub ids become local snapshots here for the Python Engine (the server resolved them
        # before it bound its port); the tensor-parallel ranks get these local paths
        self.server_args = resolve_hub_paths(self.server_args)
        args = self.server_args
        if args.random_seed is not None:
            torch.manual_seed(args.random_seed)
        self.model_path_arg = args.model_path or default_model_path()
        check_model_path(self.model_path_arg)
        # absolute, so that clients on this machine (sglang-router loads the tokenizer from
        # the model_path a worker reports) find it from any working directory
        self.model_path = os.path.abspath(self.model_path_arg)
        logger.info("loading tokenizer from %s", args.tokenizer_path or self.model_path)
        self.tokenizer = get_tokenizer(self.model_path, args.tokenizer_path)
        set_chat_template(self.tokenizer, args.chat_template)
        if self._given_runner is not None:
            self.model_runner = self._given_runner
            self._describe_model()
            return
        tp = None
        if args.tp_size > 1:
            from pyserve.engine.rank_launch import start_first_rank

            logger.info("starting tensor-parallel ranks 1..%d", args.tp_size - 1)
            tp, self.ranks = start_first_rank(args, args.resolved_device, self._rank_died_threadsafe)
        logger.info("loading model from %s", self.model_path)
        self.model_runner = ModelRunner.from_server_args(args, self.model_path, args.resolved_device, tp)
        self._describe_model()

    def _describe_model(self) -> None:
        args = self.server_args
        mc = self.model_runner.model_config
        self.context_len = mc.context_len
        self.model_name = (args.served_model_name or [default_name(self.model_path)])[0]
        logger.info(
            "model %s (%s) loaded: dtype=%s device=%s context_length=%d",
            self.model_name,
            mc.architecture,
            str(self.model_runner.dtype).removeprefix("torch."),
            self.model_runner.device,
            self.context_len,
        )
        logger.info(
            "KV pool: %d tokens, %.1f MiB",
            self.model_runner.max_total_num_tokens,
            self.model_runner.kv_cache_bytes / 2**20,
        )

    async def shutdown(self) -> None:
        if not self.started:
            return
        self.started = False
        gc.set_threshold(*self._gc_threshold_before)  # the embedding program's, as they were
        await self.scheduler.stop()
        # let the scheduler finish the steps in flight and end every open request with a
        # "server shutting down" abort, and the detokenizer hand those last outputs on, so
        # streams close instead of hanging
        with contextlib.suppress(Exception, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._scheduler_task), timeout=SHUTDOWN_DRAIN_S)
        queue = self.detokenizer.queue
        for _ in range(100):
            if queue.empty():
                break
            await asyncio.sleep(0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.ranks is not None:  # the worker's stop ends them: not a death
            self.ranks.expect_end()
        await asyncio.get_running_loop().run_in_executor(None, self.worker.shutdown)
        if self.ranks is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.ranks.stop)
        if self.grammar_backend is not None:
            self.grammar_backend.shutdown()
        self.tokenizer_manager.executor.shutdown(wait=False)

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests (ServerDrainingError, 503), let the running ones finish for up
        to `timeout_s`, then end the rest (EndCause.SHUTDOWN: a stream's last chunk says abort, a
        whole response gets ServerDrainingError, 503) and wait (up to DRAIN_SETTLE_S)
        until their consumers have their last output. Idempotent."""
        if not self.started:
            return
        tm = self.tokenizer_manager
        tm.draining = True
        states = tm.states
        loop = asyncio.get_running_loop()
        if states:
            logger.info("draining: %d requests running; new ones get 503", len(states))
        deadline = loop.time() + timeout_s
        while states and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if states:
            ended = self.end(list(states), EndCause.SHUTDOWN, SHUTTING_DOWN_MESSAGE)
            logger.info("drain: %d requests still running after %g s are ended", ended, timeout_s)
            deadline = loop.time() + DRAIN_SETTLE_S
            while states and loop.time() < deadline:
                await asyncio.sleep(0.05)

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call `listener(message)` on the loop when serving fails for good (a tensor-parallel
        rank died): the server then stops (`pyserve serve` exits 1)."""
        self._failure_listeners.append(listener)

    def _rank_died_threadsafe(self, rank: int, message: str) -> None:
        """A rank's watcher thread: hand the death to the loop."""
        with contextlib.suppress(RuntimeError):  # the loop is already closed: nothing runs
            self._loop.call_soon_threadsafe(self._stop_serving, message)

    def _stop_serving(self, message: str) -> None:
        """Serving cannot go on: log the one line, refuse new requests (503), end every
        request with an error (a stream's last event), tell the listeners."""
        if self.failure is not None:
            return
        self.failure = message
        logger.error("%s; the server stops", message)
        if not self.started:  # still loading: the load fails on the rank's closed sockets
            return
        tm = self.tokenizer_manager
        tm.draining = True
        self.end(list(tm.states), EndCause.SERVER_FAILED, f"{message}; the server stops")
        for listener in self._failure_listeners:
            listener(message)

    def _emit(self, outs: list[TokenOut]) -> None:
        """The scheduler's step outputs, to the detokenizer's queue."""
        self.detokenizer.queue.put_nowait(outs)

    def _deliver(self, out: GenerateOutput) -> None:
        """A detokenized output, to its consumer through the tokenizer manager."""
        self.tokenizer_manager.deliver(out)

    # ---- requests (generate, generate_all: fan_out.py) ------------------------------------------
    async def encode(self, inputs: list[str | list[int]], rid: str | None = None) -> list[GenerateOutput]:
        """Embeddings of several inputs (texts, or token-id lists), run together as
        prefill-only requests, in order: each output's `embedding` ([hidden] float32 numpy)
        and `prompt_tokens`. rid: the rid the inputs' own (`{rid}-{i}`) derive from (aborting
        it aborts them). Raises InvalidRequestError (400) for no input or an empty one
        (embedding_inputs.py), on a generation server, for an input longer than the context,
        an id outside the vocabulary or more than `--max-prompts-per-request` inputs."""
        check_embedding_inputs(inputs)
        base = rid or new_rid()
        sp = SamplingParams().model_copy(update={"max_new_tokens": 0})
        reqs = [
            SingleReq(
                text=item if isinstance(item, str) else None,
                input_ids=None if isinstance(item, str) else item,
                sampling_params=sp,
                rid=f"{base}-{i}" if len(inputs) > 1 else base,
                parent_rid=base if len(inputs) > 1 else None,
                embed=True,
            )
            for i, item in enumerate(inputs)
        ]
        outs = await self.generate_all(reqs)
        for out in outs:
            failure = end_error(out.finish_reason, streamed=False)
            if failure is not None:
                raise failure
            if out.embedding is None:  # ended before its step ran (/abort_request, shutdown)
                reason = out.finish_reason.message if out.finish_reason is not None else None
                raise InvalidRequestError(
                    f"the request was aborted before its embedding was computed: {reason or 'no reason given'}",
                    code="request_aborted",
                    status=503,
                )
        return outs

    # ---- control -------------------------------------------------------------------------------
    def forget(self, rid: str) -> None:
        """Request `rid`'s consumer left: it ends (EndCause.CLIENT_GONE), its KV is freed, and
        nothing more of it is emitted or detokenized. Loop thread."""
        self.tokenizer_manager.forget(rid)

    def end(self, rids: Iterable[str], cause: EndCause, message: str) -> int:
        """End the running requests `rids` with `cause`; each consumer gets a last output with
        finish reason abort (or the error the cause stands for: end_cause.py, server/errors.py)
        and its KV is freed. Returns how many were ended. Loop thread."""
        return self.tokenizer_manager.end(rids, cause, message)

    def rids_of(self, rid: str | None = None, every: bool = False) -> list[str]:
        """The running requests named by SGLang's abort: `rid` and those the server derived
        from it (the prompts of a batch, the samples of n > 1 and their prefill), or every one
        (`every`)."""
        states = self.tokenizer_manager.states
        if every:
            return list(states)
        return [r for r in [rid, *sorted(self._derived.get(rid or "", ()))] if r in states]

    def flush_cache(self) -> bool:
        """Empty the radix cache; False (nothing changed) while requests are queued or run."""
        return self.scheduler.flush_cache()


def _log_task_death(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine task %s died", task.get_name(), exc_info=task.exception())


def _device_memory_bytes(device: str) -> int | None:
    """Total memory of a CUDA device (None for the CPU): what the default chunk size follows."""
    if not device.startswith("cuda"):
        return None
    import torch

    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
