"""`TokenizerManager`: from a request to a stream of outputs, on the loop thread.

It tokenizes through a `BatchEncoder` (batch_encoder.py: the encoding runs on its executor
thread; the loop never runs a tokenizer), checks the request against the model's limits,
keeps a `ReqState` per `rid`, hands the tokenized request to the scheduler and yields the
detokenizer's outputs. Leaving the output iterator early (a client disconnect) ends the
request (`forget`: nothing more of it is emitted).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pyserve.engine.batch_encoder import BatchEncoder
from pyserve.engine.end_cause import end_error
from pyserve.engine.scheduler import Scheduler
from pyserve.errors import InvalidRequestError, QueueFullError, ServerDrainingError
from pyserve.forward_batch_info import EndCause, FinishReason
from pyserve.io_struct import GenerateOutput, SingleReq, TokenizedGenerateReq

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pyserve.engine.detokenizer import Detokenizer


class ReqState:
    """Outputs of one request waiting for its consumer: a deque and at most one waiting
    future (one consumer, one producer, both on the loop; lighter than an asyncio.Queue,
    which this is per streamed token)."""

    __slots__ = ("outputs", "waiter", "finished", "sink", "stream")

    def __init__(self, sink: Callable[[GenerateOutput], None] | None = None) -> None:
        self.outputs: deque[GenerateOutput] = deque()
        self.waiter: asyncio.Future | None = None
        self.finished = False
        self.sink = sink  # set: outputs go straight to it (start_stream), not to the deque
        self.stream = False  # its consumer takes chunks (set when it starts)

    def put(self, out: GenerateOutput) -> None:
        self.outputs.append(out)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> GenerateOutput:
        while not self.outputs:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.outputs.popleft()


class TokenizerManager:
    """Tokenizes, validates, tracks and ends requests (`forget`, `end`). Loop thread only."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        scheduler: Scheduler,
        detokenizer: Detokenizer,
        context_len: int,
        max_total_tokens: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        stream_interval: int = 1,
        max_queued_requests: int | None = None,
        abort_on_priority_when_disabled: bool = False,
        is_generation: bool = True,
    ) -> None:
        """detokenizer: EngineCore's, which this registers each request's text state with and
        whose outputs come back through `deliver`. is_generation: the server generates text
        (else it serves embeddings: only `SingleReq.embed` requests are taken, and those only
        there). stream_interval: the
        server's default tokens per streamed chunk (a request's own stream_interval overrides
        it). max_queued_requests: refuse new requests (503) while that many wait for
        admission; None: no limit. abort_on_priority_when_disabled: a request giving a
        priority gets a 400 when priority scheduling is off (else, as in SGLang, the priority
        is ignored: it orders requests, it never changes an output)."""
        self.abort_on_priority_when_disabled = abort_on_priority_when_disabled
        self.is_generation = is_generation
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.max_queued_requests = max_queued_requests
        self.scheduler = scheduler
        self.context_len = context_len
        self.max_total_tokens = max_total_tokens
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.encoder = BatchEncoder(tokenizer)
        # the tokenizer's thread, also for EngineCore's and the routes' decodes
        self.executor = self.encoder.executor
        self.states: dict[str, ReqState] = {}
        self.draining = False  # new requests are refused (EngineCore.drain)
        self.detokenizer = detokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """Token ids of `text`, [n] int32, encoded on the executor thread in one batched call
        with the texts of the requests arriving together (see `BatchEncoder.encode`)."""
        return await self.encoder.encode(text, add_special_tokens)

    def _checked_ids(self, input_ids: Sequence[int], param: str = "input_ids") -> np.ndarray:
        """Given token ids as [n] int32, made once. Raises InvalidRequestError for an id
        outside the vocabulary."""
        if not isinstance(input_ids, (list, tuple, np.ndarray)):
            input_ids = list(input_ids)  # any other iterable of ids, read once
        try:
            ids = np.asarray(input_ids, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):  # an id beyond int64, or not a number
            ids = None
        if ids is not None and ids.ndim == 1:
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][:1].tolist()
        else:  # not a flat list of integers: name the first bad item, or the whole value
            in_vocab = [isinstance(t, int) and 0 <= t < self.vocab_size for t in input_ids]
            bad = [t for t, ok in zip(input_ids, in_vocab) if not ok][:1] or [input_ids]
        if bad:
            raise InvalidRequestError(
                f"{param} contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})", param=param
            )
        assert ids is not None
        return ids.astype(np.int32)

    async def tokenize(self, req: SingleReq) -> TokenizedGenerateReq:
        """Token ids of the request, validated. Raises InvalidRequestError."""
        arrival_time = time.perf_counter()
        if req.embed == self.is_generation:
            raise InvalidRequestError(
                "this server generates text: embeddings need a server of an embedding model "
                "(an encoder such as BertModel, or a decoder with --is-embedding)"
                if req.embed
                else "this server serves an embedding model: it answers /v1/embeddings and /encode, not generation",
                param="input" if req.embed else "model",
            )
        if req.input_ids is not None:
            ids = self._checked_ids(req.input_ids, "input" if req.embed else "input_ids")
        else:
            text = req.text or ""
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequestError(
                    f"the prompt is not valid Unicode (a lone surrogate at character {exc.start})", param="prompt"
                ) from exc
            ids = await self.encode(text, req.add_special_tokens)
        if len(ids) == 0:
            raise InvalidRequestError("the prompt is empty (no tokens)", param="input" if req.embed else "prompt")
        if req.embed:  # the whole input is one prefill step: it may fill the context
            if len(ids) > min(self.context_len, self.max_total_tokens):
                raise InvalidRequestError(
                    f"the input has {len(ids)} tokens; this model's context length is {self.context_len}",
                    param="input",
                    code="context_length_exceeded",
                )
        elif len(ids) >= self.context_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this model's context length is "
                f"{self.context_len}, which must also leave room for at least one output token",
                param="prompt",
                code="context_length_exceeded",
            )
        elif len(ids) >= self.max_total_tokens:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but the KV pool holds {self.max_total_tokens}",
                param="prompt",
                code="context_length_exceeded",
            )
        sp = req.sampling_params
        # asked for explicitly: refused when it cannot fit, as SGLang, vLLM and OpenAI do (the
        # default, 128, is cut to the room left, as SGLang does)
        if sp.max_new_tokens is not None and "max_new_tokens" in sp.model_fields_set:
            total = len(ids) + sp.max_new_tokens
            if total > self.context_len:
                raise InvalidRequestError(
                    f"requested {total} tokens ({len(ids)} of prompt + {sp.max_new_tokens} "
                    f"max_new_tokens); this model's context length is {self.context_len}: "
                    "shorten the prompt or lower max_new_tokens",
                    param="max_new_tokens",
                    code="context_length_exceeded",
                )
            if total > self.max_total_tokens:
                raise InvalidRequestError(
                    f"requested {total} tokens ({len(ids)} of prompt + {sp.max_new_tokens} "
                    f"max_new_tokens) but the KV pool holds {self.max_total_tokens}: it could "
                    "never run",
                    param="max_new_tokens",
                    code="context_length_exceeded",
                )
        stop_ids = set(sp.stop_token_ids or ())
        if sp.grammar_key is not None:
            if not self.scheduler.accepts_grammars:
                kind = sp.grammar_key[0]
                raise InvalidRequestError(
                    f"{kind}: structured output is off on this server (--grammar-backend none, or a "
                    "model without an EOS token)",
                    param=kind,
                )
        if not sp.ignore_eos or sp.grammar_key is not None:
            # a grammar that ended allows only EOS: it ends the request even with ignore_eos
            stop_ids |= self.eos_token_ids
        lp = req.logprob
        for name, token_ids in (
            ("logit_bias", [t for t, _ in sp.logit_bias_items]),
            ("token_ids_logprob", lp.token_ids_logprob or []),
            ("stop_token_ids", sp.stop_token_ids or []),
        ):
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} names token {bad[0]}, outside the vocabulary [0, {self.vocab_size})", param=name
                )
        if sp.min_new_tokens > 0 and len(stop_ids) >= self.vocab_size:
            raise InvalidRequestError(
                "stop_token_ids and EOS cover the whole vocabulary: with min_new_tokens no token is left to sample",
                param="min_new_tokens",
            )
        if lp.logprob_start_len is not None and lp.logprob_start_len >= len(ids):
            lp.logprob_start_len = None  # nothing of the prompt to report
        quiet = not req.stream and not sp.stop_strs and not lp.return_logprob
        if (
            req.priority is not None
            and not self.scheduler.enable_priority_scheduling
            and self.abort_on_priority_when_disabled
        ):
            raise InvalidRequestError(
                "priority scheduling is not enabled (--enable-priority-scheduling)", param="priority"
            )
        priority = self.scheduler.priority_of(req.priority)
        return TokenizedGenerateReq(
            req.rid,
            ids,
            sp,
            frozenset(stop_ids),
            lp,
            quiet=quiet,
            priority=priority,
            grammar_think=req.grammar_think if sp.grammar_key is not None else None,
            arrival_time=arrival_time,
        )

    async def generate(
        self, req: SingleReq, tokenized: TokenizedGenerateReq | None = None
    ) -> AsyncGenerator[GenerateOutput, None]:
        """Yield outputs: every chunk when req.stream, else only the final one.

        `tokenized`: the result of `tokenize(req)` when the caller already has it.
        Raises InvalidRequestError before anything is yielded when the request is invalid
        (or, after chunks, when its own sampling parameters left no token to sample),
        ModelStepError (after any chunks) when a model step failed while it ran.
        Closing the iterator before the end aborts the request and frees its KV.
        """
        treq = tokenized or await self.tokenize(req)
        self.check_can_start(req)
        state = self._begin(req, treq, ReqState())
        try:
            while True:
                out = await state.get()
                if out.finished:
                    state.finished = True
                    failure = end_error(out.finish_reason, req.stream)
                    if failure is not None:
                        raise failure
                    yield out
                    return
                if req.stream:  # the detokenizer delivers every stream_interval tokens
                    yield out
        finally:
            self.states.pop(req.rid, None)
            if not state.finished:
                self.forget(req.rid)

    def start_stream(self, req: SingleReq, treq: TokenizedGenerateReq, sink: Callable[[GenerateOutput], None]) -> None:
        """Start `req` (tokenized as `treq`) with its outputs handed to `sink` as they come,
        synchronously on the loop (every chunk when req.stream, else the final output; a
        failure is the final output with its finish reason's `EndCause`, not an exception).
        The caller must call `forget(rid)` if it stops listening before the final
        output. Raises what `check_can_start` raises."""
        self.check_can_start(req)
        self._begin(req, treq, ReqState(sink))

    def check_can_start(self, req: SingleReq) -> None:
        """Raise ServerDrainingError (503) once the engine drains, InvalidRequestError if req's
        rid is already running, QueueFullError (503) if `max_queued_requests` requests already
        wait (SGLang's --max-queued-requests)."""
        if self.draining:
            raise ServerDrainingError()
        if req.rid in self.states:
            raise InvalidRequestError(f"a request with rid {req.rid!r} is already running", param="rid")
        limit = self.max_queued_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            # with priority scheduling a more urgent request takes the place of the least
            # urgent waiting one (the newest of equals), which gets the 503 instead (SGLang)
            if not self.scheduler.bump_for(self.scheduler.priority_of(req.priority)):
                raise QueueFullError(f"the request queue is full ({limit} requests waiting); retry later")

    def _begin(self, req: SingleReq, treq: TokenizedGenerateReq, state: ReqState) -> ReqState:
        """Track `state` for req's rid, register its text state, hand it to the scheduler."""
        state.stream = req.stream
        self.states[req.rid] = state
        sp = req.sampling_params
        self.detokenizer.register(
            req.rid,
            sp.stop_strs,
            sp.skip_special_tokens,
            treq.logprob,
            prompt_ids=treq.input_ids,
            no_stop_trim=sp.no_stop_trim,
            stream=req.stream,
            stream_interval=sp.stream_interval or self.stream_interval,
        )
        self.scheduler.add_request(treq)
        return state

    def forget(self, rid: str) -> None:
        """Its consumer left (a client disconnect, an iterator closed early): the request
        ends (EndCause.CLIENT_GONE), its KV is freed, and nothing more of it is emitted or
        detokenized. Unknown rids are ignored."""
        self.states.pop(rid, None)
        self.detokenizer.forget(rid)
        self.scheduler.end(rid, FinishReason.abort(EndCause.CLIENT_GONE, "the client left"), emit=False)

    def pause_request(self, rid: str, paused: bool) -> None:
        """Its streaming client is behind (True) or caught up: the request's decoding pauses
        meanwhile (Scheduler.pause_request)."""
        self.scheduler.pause_request(rid, paused)

    def end(self, rids: Iterable[str], cause: EndCause, message: str) -> int:
        """End the running requests `rids` with `cause`: each consumer receives a last output
        with finish reason abort (`end_cause.end_error` says what it raises); their KV is
        freed. Unknown rids are skipped. Returns how many were ended."""
        reason = FinishReason.abort(cause, message)
        ended = 0
        for rid in rids:
            if rid in self.states:
                self.scheduler.end(rid, reason)
                ended += 1
        return ended

    def deliver(self, out: GenerateOutput) -> None:
        """Hand `out` (the detokenizer's) to its request's consumer; a forgotten rid's is
        dropped. Loop thread."""
        state = self.states.get(out.rid)
        if state is None:
            return
        if state.sink is None:
            state.put(out)
            return
        if out.finish_reason is not None:
            state.finished = True
            del self.states[out.rid]
        state.sink(out)
