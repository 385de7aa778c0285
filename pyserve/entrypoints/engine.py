"""`Engine`: pyserve in-process, without HTTP, for Python programs.

The Engine runs an EngineCore on its own thread with its own uvloop event loop, so it works
from plain synchronous code and from any asyncio loop. Outputs are dicts in the same shape
as /generate: {"text", "output_ids", "meta_info": {...}}; streamed chunks carry the text so
far (cumulative), like /generate's stream. `chat` renders messages as /v1/chat/completions
does (the server's own code: chat template, tools, reasoning and tool-call parsers). A bad
request raises the error the HTTP API answers with (InvalidRequestError: the same message
and param).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import numbers
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from pydantic import ValidationError

from pyserve.config import ServerArgs, setup_logging
from pyserve.engine.engine_core import EngineCore
from pyserve.errors import InvalidRequestError
from pyserve.forward_batch_info import ABORTED_MESSAGE, EndCause
from pyserve.io_struct import GenerateOutput, GenerateReqInput, SingleReq
from pyserve.sampling_params import GRAMMAR_KINDS, SamplingParams
from pyserve.server.errors import request_error
from pyserve.server.openai.chat_reply import ReplyPlan, parse_reply
from pyserve.server.openai.protocol import ChatCompletionRequest
from pyserve.server.openai.serving import chat_request

# what Engine.chat takes besides messages, sampling_params and tools: the fields of
# /v1/chat/completions that are not sampling parameters
CHAT_OPTIONS = frozenset(
    {
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "separate_reasoning",
        "thinking_budget",
        "rid",
    }
)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # Windows
        return asyncio.new_event_loop()


class Engine:
    """Load a model and generate from Python.

    `Engine(model_path=..., **server_args)` takes ServerArgs fields as keyword arguments (its
    signature lists them) and blocks until the model is loaded. Its start-up lines (the
    model, the KV pool) are logged as `pyserve serve` logs them, through a stderr handler
    unless the program configured logging itself. `model_path` / `tokenizer_path` may be
    Hugging Face Hub ids (with `revision`), downloaded unless cached. Raises ServerArgsError
    for bad arguments, ModelNotFoundError (a ValueError, one line) for a model path or Hub id
    it cannot find or fetch, and whatever loading raises. Thread-safe: calls may come from
    any thread or loop.
    """

    def __init__(self, server_args: ServerArgs | None = None, **kwargs: Any) -> None:
        self.server_args = server_args or ServerArgs(**kwargs)
        setup_logging(self.server_args.log_level)
        self.core = EngineCore(self.server_args)
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pyserve-engine-loop", daemon=True)
        self._thread.start()
        try:
            self._call(self.core.start())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @staticmethod
    def _request(
        prompt: str | list[str] | None, sampling_params: Any, input_ids: Any, stream: bool, options: dict[str, Any]
    ) -> GenerateReqInput:
        try:
            return GenerateReqInput(
                text=prompt, input_ids=input_ids, sampling_params=sampling_params, stream=stream, **options
            )
        except ValidationError as exc:  # (pydantic's text names pyserve's classes: the API's does not)
            raise request_error(exc) from None

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        **options: Any,
    ) -> Any:
        """Generate from one prompt (dict), a list (list of dicts) or, with stream=True, one
        prompt as an iterator of chunk dicts. `options`: other /generate fields
        (return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob,
        return_text_in_logprobs, rid). Raises InvalidRequestError for malformed parameters
        (the message /generate answers with, e.g. "Unrecognized request argument supplied:
        sampling_params.temperatur") and for requests the model cannot serve."""
        obj = self._request(prompt, sampling_params, input_ids, stream, options)
        if stream:
            return self._stream_sync(obj)
        outs = self._call(self.core.generate_all(obj.split()))
        dicts = [o.to_native() for o in outs]
        return dicts if obj.is_batch or len(dicts) > 1 else dicts[0]

    def _stream_sync(self, obj: GenerateReqInput) -> Iterator[dict[str, Any]]:
        agen = self.core.generate(obj.split()[0])
        try:
            while True:
                try:
                    out = self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield out.to_native()
        finally:
            self._call(agen.aclose())

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        **options: Any,
    ) -> Any:
        """Like generate, awaitable from any event loop; with stream=True returns an async
        iterator of chunk dicts."""
        obj = self._request(prompt, sampling_params, input_ids, stream, options)
        if stream:
            return self._stream_async(obj)
        fut = asyncio.run_coroutine_threadsafe(self.core.generate_all(obj.split()), self._loop)
        outs = await asyncio.wrap_future(fut)
        dicts = [o.to_native() for o in outs]
        return dicts if obj.is_batch or len(dicts) > 1 else dicts[0]

    async def _stream_async(self, obj: GenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        agen = self.core.generate(obj.split()[0])

        async def on_engine(coro: Any) -> Any:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

        try:
            while True:
                try:
                    out = await on_engine(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield out.to_native()
        finally:
            await on_engine(agen.aclose())

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: dict[str, Any] | SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        **options: Any,
    ) -> Any:
        """The assistant's reply to chat `messages` (OpenAI's message objects), generated as
        /v1/chat/completions generates it: the same chat template, tools (OpenAI's function
        objects; with tool_choice auto the server's --tool-call-parser finds the calls) and
        reasoning split (--reasoning-parser). `sampling_params`: /generate's names
        (max_new_tokens, temperature, stop, json_schema, ...). `options`: the chat fields
        that are not sampling parameters (CHAT_OPTIONS: tool_choice, parallel_tool_calls,
        chat_template_kwargs, add_generation_prompt, continue_final_message,
        separate_reasoning, thinking_budget, rid).

        Returns generate's dict ({"text", "output_ids", "meta_info"}; a list of them for n > 1)
        with "message": the assistant message the API's choice carries ({"role":
        "assistant", "content"}, plus "reasoning_content" when the reasoning is split and
        "tool_calls" when calls were parsed). Not streamed. Raises InvalidRequestError (the
        API's message and param) for malformed messages, parameters or options and for
        requests the model cannot serve. Any thread."""
        return self._call(self._chat(messages, sampling_params, tools, options))

    async def async_chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: dict[str, Any] | SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        **options: Any,
    ) -> Any:
        """Like chat, awaitable from any event loop."""
        fut = asyncio.run_coroutine_threadsafe(self._chat(messages, sampling_params, tools, options), self._loop)
        return await asyncio.wrap_future(fut)

    async def _chat(
        self, messages: Any, sampling_params: Any, tools: Any, options: dict[str, Any]
    ) -> dict[str, Any] | list[dict[str, Any]]:
        # on the engine's loop (the chat template renders there, as in the server)
        sp = _sampling_params(sampling_params)
        req, plan = await _chat_req(self.core, messages, sp, tools, options)
        outs = await self.core.generate_all([req])
        dicts = [_chat_output(out, plan) for out in outs]
        return dicts[0] if len(dicts) == 1 else dicts

    def encode(
        self, prompt: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None
    ) -> Any:
        """Embeddings of one input (a dict) or a list (a list of dicts), each SGLang's /encode
        shape: {"embedding": [hidden floats], "meta_info": {"prompt_tokens", ...}}. Give
        texts (`prompt`) or token ids (`input_ids`). Raises InvalidRequestError on a
        generation server and for inputs the model cannot take (empty, longer than the
        context, ids outside the vocabulary)."""
        inputs, single = _encode_inputs(prompt, input_ids)
        outs = self._call(self.core.encode(inputs))
        dicts = [o.to_native_embedding() for o in outs]
        return dicts[0] if single else dicts

    async def async_encode(
        self, prompt: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None
    ) -> Any:
        """Like encode, awaitable from any event loop."""
        inputs, single = _encode_inputs(prompt, input_ids)
        outs = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.core.encode(inputs), self._loop))
        dicts = [o.to_native_embedding() for o in outs]
        return dicts[0] if single else dicts

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> int:
        """End the request `rid` (and those the engine derived from it: the prompts of a
        batch, the samples of n > 1), or all with `abort_all`; their outputs finish with
        reason abort. Returns how many were ended. Any thread."""

        async def abort() -> int:
            core = self.core
            return core.end(core.rids_of(rid, every=abort_all), EndCause.ABORTED, ABORTED_MESSAGE)

        return self._call(abort())

    def flush_cache(self) -> bool:
        """Empty the radix cache; False (nothing changed) while requests run. Any thread."""

        async def flush() -> bool:
            return self.core.flush_cache()

        return self._call(flush())

    def get_server_info(self) -> dict[str, Any]:
        async def info() -> dict[str, Any]:
            return self.core.get_server_info()

        return self._call(info())

    def start_expert_distribution_record(self) -> None:
        """Count each MoE layer's tokens per expert from now (SGLang's Engine method; the
        routes of pyserve/server/expert_routes.py). Raises InvalidRequestError for a dense
        model. Any thread."""

        async def start() -> None:
            self.core.start_expert_distribution_record()

        self._call(start())

    def stop_expert_distribution_record(self) -> None:
        """Stop counting (the counts stay). Raises InvalidRequestError for a dense model."""

        async def stop() -> None:
            self.core.stop_expert_distribution_record()

        self._call(stop())

    def dump_expert_distribution_record(self) -> dict[str, Any]:
        """{"logical_count": [[tokens per expert] per sparse layer], "layers", "recording"}."""

        async def dump() -> dict[str, Any]:
            return self.core.dump_expert_distribution_record()

        return self._call(dump())

    def shutdown(self) -> None:
        """Drain (new requests raise ServerDrainingError; running ones may finish for
        `shutdown_timeout_s`, then end with finish reason abort), then stop the engine and its
        threads. Idempotent."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            self._call(self.core.drain(self.server_args.shutdown_timeout_s))
            self._call(self.core.shutdown())
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _sampling_params(given: Any) -> SamplingParams:
    """`given` (a dict of /generate's names, a SamplingParams or None) as SamplingParams;
    InvalidRequestError as /generate words it."""
    if isinstance(given, SamplingParams):
        return given
    try:
        return SamplingParams.model_validate(given or {})
    except ValidationError as exc:
        raise request_error(exc, ("sampling_params",)) from None


async def _chat_req(
    core: EngineCore, messages: Any, sp: SamplingParams, tools: Any, options: dict[str, Any]
) -> tuple[SingleReq, ReplyPlan | None]:
    """The request /v1/chat/completions would run for these messages, tools and options, with
    `sp` as its sampling parameters, and the plan of its reply's parsers. The route's body is
    given what of `sp` the route reads itself: the output limit (a grammar's thinking budget
    follows it), a grammar (it meets the tools' in one check) and skip_special_tokens (a
    tool-call format may need the special tokens)."""
    unknown = sorted(set(options) - CHAT_OPTIONS)
    if unknown:
        raise InvalidRequestError(
            f"Unrecognized argument: {unknown[0]} (sampling parameters go in sampling_params; the chat options "
            f"are {', '.join(sorted(CHAT_OPTIONS))})",
            param=unknown[0],
        )
    fields: dict[str, Any] = {"messages": messages, **options, "max_tokens": sp.max_new_tokens}
    if tools is not None:
        fields["tools"] = tools
    for kind in GRAMMAR_KINDS:
        if getattr(sp, kind) is not None:
            fields[kind] = getattr(sp, kind)
    if "skip_special_tokens" in sp.model_fields_set:
        fields["skip_special_tokens"] = sp.skip_special_tokens
    try:
        body = ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise request_error(exc) from None
    body.check_supported()
    req, _prompt, plan, _constraint = await chat_request(core, body)
    route_sp = req.sampling_params
    update = {kind: getattr(route_sp, kind) for kind in GRAMMAR_KINDS}
    update["skip_special_tokens"] = route_sp.skip_special_tokens
    return dataclasses.replace(req, sampling_params=sp.model_copy(update=update)), plan


def _chat_output(out: GenerateOutput, plan: ReplyPlan | None) -> dict[str, Any]:
    """generate's dict of a chat reply, with the assistant message the API's choice carries."""
    message = {"role": "assistant", "content": out.text} if plan is None else parse_reply(plan, out.text)[0]
    return {**out.to_native(), "message": message}


def _encode_inputs(prompt: Any, input_ids: Any) -> tuple[list[str | list[int]], bool]:
    """(the inputs as a list, whether one was given alone). Raises InvalidRequestError unless
    exactly one of the two is given."""
    if (prompt is None) == (input_ids is None):
        raise InvalidRequestError("give either prompt or input_ids", param="prompt")
    if prompt is not None:
        if isinstance(prompt, str):
            return [prompt], True
        texts = list(prompt)
        if not all(isinstance(t, str) for t in texts):
            raise InvalidRequestError(
                "prompt must be a string or a list of strings (ids go in input_ids)", param="prompt"
            )
        return texts, False
    if len(input_ids) and isinstance(input_ids[0], numbers.Integral):  # one id list (numpy too)
        return [[int(t) for t in input_ids]], True
    return [[int(t) for t in ids] for ids in input_ids], False


def _init_signature() -> inspect.Signature:
    """Engine.__init__'s signature with every ServerArgs field as a keyword-only parameter,
    for help(), IDEs and notebooks (the code takes them as **kwargs)."""
    kind = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("server_args", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
    ]
    for f in dataclasses.fields(ServerArgs):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=f.type))
    return inspect.Signature(params)


Engine.__init__.__signature__ = _init_signature()  # type: ignore[attr-defined]
