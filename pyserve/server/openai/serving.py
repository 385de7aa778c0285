"""Route handlers of the OpenAI-compatible API: chat completions, completions, models.

Responses follow the OpenAI API's shapes (ids, `object`, `created`, `usage` with
`prompt_tokens_details.cached_tokens`); streams send `chat.completion.chunk` /
`text_completion` deltas and end with `data: [DONE]`. With `n > 1` a choice per sample
(index = prompt index * n + sample), each finishing once; usage counts each prompt once.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.engine.engine_core import EngineCore
from pyserve.errors import InvalidRequestError
from pyserve.io_struct import GenerateOutput, SingleReq, new_rid
from pyserve.server.errors import parse_json
from pyserve.server.render import SafeJSONResponse
from pyserve.server.native import anext_or_none, engine_of
from pyserve.server.openai.logprobs import chat_logprobs, completion_logprobs, text_end
from pyserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from pyserve.server.sse import sse_response, until_disconnect


def finish_reason(out: GenerateOutput) -> str | None:
    if out.finish_reason is None:
        return None
    return out.finish_reason.kind.value


def usage(outs: list[GenerateOutput], n: int = 1) -> dict[str, Any]:
    """Usage of final (or, streaming, latest) outputs: `outs` holds n samples per prompt in a
    row; each prompt counts once, with the cached tokens its samples found (the most any
    sample found)."""
    groups = [outs[i:i + n] for i in range(0, len(outs), n)]
    prompt = sum(g[0].prompt_tokens for g in groups)
    completion = sum(len(o.output_ids) for o in outs)
    cached = sum(max(o.cached_tokens for o in g) for g in groups)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def model_name(engine: EngineCore, requested: str | None) -> str:
    """See EngineCore.resolve_model (404 model_not_found for a model not served here)."""
    return engine.resolve_model(requested)


def _index(out: GenerateOutput) -> int:
    return out.index or 0


class _StreamState:
    """Per-choice progress of a stream: which outputs are latest, logprobs already sent."""

    def __init__(self, first: GenerateOutput | None) -> None:
        # the first output stands for every choice until each has its own (usage so far)
        self.latest: dict[int, GenerateOutput] = {} if first is None else {_index(first): first}
        self.sent_logprobs: dict[int, int] = {}

    def usage(self) -> dict[str, Any]:
        """Usage of the choices so far (the prompt counted once)."""
        return _prompt_once([self.latest[i] for i in sorted(self.latest)])

    def chunk(self, body: "ChatCompletionRequest | CompletionRequest", base: dict[str, Any],
              choice: dict[str, Any]) -> dict[str, Any]:
        """One streamed chunk: `base` (id, object, created, model) with one choice and the
        usage the request's stream_options ask for."""
        out = {**base, "choices": [choice]}
        if body.continuous_usage:
            out["usage"] = self.usage()
        elif body.include_usage:
            out["usage"] = None  # as OpenAI: only the last chunk carries usage
        return out

    def update(self, out: GenerateOutput) -> tuple[int, int]:
        """Record `out`; returns (its choice index, output logprobs sent before it)."""
        i = _index(out)
        self.latest[i] = out
        sent = self.sent_logprobs.get(i, 0)
        if out.logprobs is not None:
            self.sent_logprobs[i] = len(out.logprobs["output_token_logprobs"])
        return i, sent


def _prompt_once(outs: list[GenerateOutput]) -> dict[str, Any]:
    """Usage fields of the samples of one prompt so far (prompt counted once)."""
    prompt = outs[0].prompt_tokens if outs else 0
    completion = sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": max((o.cached_tokens for o in outs), default=0)}}


async def chat_completions(request: Request) -> Response:
    body = ChatCompletionRequest.model_validate(await parse_json(request))
    body.check_supported()
    engine = engine_of(request)
    name = model_name(engine, body.model)
    prompt = await engine.apply_chat_template([m.to_template() for m in body.messages],
                                              **body.template_kwargs())
    req = SingleReq(text=prompt, input_ids=None, sampling_params=body.sampling_params(body.max_new_tokens),
                    stream=body.stream, add_special_tokens=body.add_special_tokens,
                    logprob=body.logprob_params(), rid=body.rid or new_rid(), priority=body.priority)
    rid = f"chatcmpl-{req.rid}"
    created = int(time.time())
    if body.stream:
        stream = engine.generate(req)
        first = await anext_or_none(stream)
        return sse_response(_chat_chunks(first, stream, rid, created, name, body))
    outs = await until_disconnect(request, engine.generate_all([req]))
    return SafeJSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": name,
        "choices": [{"index": i, "message": {"role": "assistant", "content": out.text},
                     "logprobs": chat_logprobs(out, 0), "finish_reason": finish_reason(out),
                     "matched_stop": out.finish_reason.matched if out.finish_reason else None}
                    for i, out in enumerate(outs)],
        "usage": usage(outs, body.n),
    })


async def _chat_chunks(first: GenerateOutput | None, rest: AsyncIterator[GenerateOutput], rid: str,
                       created: int, name: str, body: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
    state = _StreamState(first)
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name}

    def chunk(index: int, delta: dict[str, Any], reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        return state.chunk(body, base, {"index": index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": reason})

    try:
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None)
        out = first
        while out is not None:
            i, sent = state.update(out)
            # a chunk carries the logprobs of the tokens it adds (even with no text yet)
            new_logprobs = out.logprobs is not None and out.num_logprobs_delta > 0
            if out.text_delta or new_logprobs:
                logprobs = chat_logprobs(out, sent) if new_logprobs else None
                yield chunk(i, {"content": out.text_delta}, None, logprobs)
            if out.finished:
                yield chunk(i, {}, finish_reason(out))
            out = await anext_or_none(rest)
        if body.include_usage:
            yield {**base, "choices": [], "usage": state.usage()}
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def completions(request: Request) -> Response:
    body = CompletionRequest.model_validate(await parse_json(request))
    body.check_supported()
    engine = engine_of(request)
    name = model_name(engine, body.model)
    base_rid = body.rid or new_rid()
    prompts = body.prompts()
    reqs = [SingleReq(text=text, input_ids=ids, sampling_params=body.sampling_params(body.max_tokens),
                      stream=body.stream, logprob=body.logprob_params(),
                      add_special_tokens=body.add_special_tokens,
                      rid=base_rid if len(prompts) == 1 else f"{base_rid}-p{k}",
                      parent_rid=None if len(prompts) == 1 else base_rid, priority=body.priority)
            for k, (text, ids) in enumerate(prompts)]
    rid = f"cmpl-{base_rid}"
    created = int(time.time())
    if body.stream:
        stream = engine.generate(reqs[0])
        first = await anext_or_none(stream)  # validates the prompt before echoing it
        echo = await _echo(engine, reqs[0], body)
        return sse_response(_completion_chunks(first, stream, rid, created, name, body, echo))
    outs = await until_disconnect(request, engine.generate_all(reqs))
    echoes = [await _echo(engine, r, body) for r in reqs]
    choices = []
    for i, o in enumerate(outs):
        prefix, prompt_offsets = echoes[i // body.n]
        choices.append({
            "index": i, "text": prefix + o.text,
            "logprobs": completion_logprobs(o, 0, echo=body.echo, text_offset=len(prefix),
                                            prompt_offsets=prompt_offsets),
            "finish_reason": finish_reason(o), "matched_stop": o.finish_reason.matched if o.finish_reason else None})
    return SafeJSONResponse({"id": rid, "object": "text_completion", "created": created, "model": name,
                             "choices": choices, "usage": usage(outs, body.n)})


async def _echo(engine: EngineCore, req: SingleReq, body: CompletionRequest) -> tuple[str, list[int] | None]:
    """The echoed prompt text ("" without echo) and, with logprobs, its tokens' offsets."""
    if not body.echo:
        return "", None
    if body.logprobs is None:
        return await engine.prompt_text(req), None
    return await engine.prompt_text_offsets(req)


async def _completion_chunks(first: GenerateOutput | None, rest: AsyncIterator[GenerateOutput],
                             rid: str, created: int, name: str, body: CompletionRequest,
                             echoed: tuple[str, list[int] | None]) -> AsyncIterator[dict[str, Any]]:
    state = _StreamState(first)
    echo, prompt_offsets = echoed
    base = {"id": rid, "object": "text_completion", "created": created, "model": name}

    def chunk(index: int, text: str, reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        return state.chunk(body, base, {"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": reason})

    try:
        # character offset of each choice's next token (logprobs): where the last sent
        # token's text ends, whatever text is still held back for a stop string
        offsets = [len(echo)] * body.n
        if body.echo:
            # the prompt's logprobs (echo) go with the echoed prompt
            prompt_lp = None
            if first is not None and first.logprobs is not None:
                prompt_lp = completion_logprobs(first, 0, 0, echo=True, prompt_offsets=prompt_offsets)
            for i in range(body.n):
                yield chunk(i, echo, None, prompt_lp)
        out = first
        while out is not None:
            i, sent = state.update(out)
            new_logprobs = out.logprobs is not None and out.num_logprobs_delta > 0
            if out.text_delta or out.finished or new_logprobs:
                logprobs = None
                if out.logprobs is not None:
                    logprobs = completion_logprobs(out, sent, text_offset=offsets[i])
                    if logprobs["tokens"]:
                        offsets[i] = text_end(logprobs)
                yield chunk(i, out.text_delta, finish_reason(out), logprobs)
            out = await anext_or_none(rest)
        if body.include_usage:
            yield {**base, "choices": [], "usage": state.usage()}
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


def _model_card(engine: EngineCore) -> dict[str, Any]:
    return {"id": engine.model_name, "object": "model", "created": int(engine.start_time),
            "owned_by": "pyserve", "root": engine.model_path, "max_model_len": engine.context_len}


async def list_models(request: Request) -> Response:
    return SafeJSONResponse({"object": "list", "data": [_model_card(engine_of(request))]})


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{id}: the served model under any name the routes accept, else 404."""
    engine = engine_of(request)
    model_name(engine, request.path_params["model_id"])
    return SafeJSONResponse(_model_card(engine))


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
]
