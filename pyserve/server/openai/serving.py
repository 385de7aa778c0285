"""Route handlers of the OpenAI-compatible API: chat completions, completions, models.

Responses follow the OpenAI API's shapes (ids, `object`, `created`, `usage` with
`prompt_tokens_details.cached_tokens`); streams send `chat.completion.chunk` /
`text_completion` deltas and end with `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pyserve.engine.engine_core import EngineCore
from pyserve.errors import InvalidRequestError
from pyserve.io_struct import GenerateOutput, SingleReq
from pyserve.server.errors import parse_json
from pyserve.server.native import anext_or_none, engine_of
from pyserve.server.openai.logprobs import chat_logprobs, completion_logprobs
from pyserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from pyserve.server.sse import sse_response, until_disconnect


def finish_reason(out: GenerateOutput) -> str | None:
    if out.finish_reason is None:
        return None
    kind = out.finish_reason.get("type")
    return "length" if kind == "length" else "stop" if kind == "stop" else "abort"


def usage(outs: list[GenerateOutput]) -> dict[str, Any]:
    prompt = sum(o.prompt_tokens for o in outs)
    completion = sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)}}


def model_name(engine: EngineCore, requested: str | None) -> str:
    """The served model's name for a request's `model` field, which may be left out or name
    the served model (its served name, "default" as SGLang clients send, or its path).
    Raises InvalidRequestError (404, code "model_not_found") for any other model, as the
    OpenAI API and vLLM do."""
    if requested is None or requested in (engine.model_name, "default", str(engine.model_path)):
        return engine.model_name
    raise InvalidRequestError(
        f"The model `{requested}` does not exist; this server serves `{engine.model_name}`.",
        param="model", code="model_not_found", status=404)


async def chat_completions(request: Request) -> Response:
    body = ChatCompletionRequest.model_validate(await parse_json(request))
    body.check_supported()
    engine = engine_of(request)
    name = model_name(engine, body.model)
    prompt = await engine.apply_chat_template([m.to_template() for m in body.messages])
    req = SingleReq(text=prompt, input_ids=None, sampling_params=body.sampling_params(body.max_new_tokens),
                    stream=body.stream, add_special_tokens=False, logprob=body.logprob_params())
    rid = f"chatcmpl-{req.rid}"
    created = int(time.time())
    if body.stream:
        stream = engine.generate(req)
        first = await anext_or_none(stream)
        return sse_response(_chat_chunks(first, stream, rid, created, name, body.include_usage))
    outs = await until_disconnect(request, engine.generate_all([req]))
    out = outs[0]
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                     "logprobs": chat_logprobs(out, 0), "finish_reason": finish_reason(out),
                     "matched_stop": (out.finish_reason or {}).get("matched")}],
        "usage": usage([out]),
    })


async def _chat_chunks(first: GenerateOutput | None, rest: AsyncIterator[GenerateOutput], rid: str,
                       created: int, name: str, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    def chunk(delta: dict[str, Any], reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
               "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
        if include_usage:
            out["usage"] = None  # as OpenAI: only the last chunk carries usage
        return out

    try:
        yield chunk({"role": "assistant", "content": ""}, None)
        out = first
        sent_logprobs = 0
        while out is not None:
            # a chunk carries the logprobs of the tokens it adds (even with no text yet)
            new_logprobs = out.logprobs is not None and out.num_logprobs_delta > 0
            if out.text_delta or new_logprobs:
                logprobs = chat_logprobs(out, sent_logprobs) if new_logprobs else None
                if out.logprobs is not None:
                    sent_logprobs = len(out.logprobs["output_token_logprobs"])
                yield chunk({"content": out.text_delta}, None, logprobs)
            if out.finished:
                yield chunk({}, finish_reason(out))
                if include_usage:
                    yield {"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": name, "choices": [], "usage": usage([out])}
                return
            out = await anext_or_none(rest)
    finally:
        await rest.aclose()


async def completions(request: Request) -> Response:
    body = CompletionRequest.model_validate(await parse_json(request))
    body.check_supported()
    engine = engine_of(request)
    name = model_name(engine, body.model)
    reqs = [SingleReq(text=text, input_ids=ids, sampling_params=body.sampling_params(body.max_tokens),
                      stream=body.stream, logprob=body.logprob_params()) for text, ids in body.prompts()]
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if body.stream:
        stream = engine.generate(reqs[0])
        first = await anext_or_none(stream)  # validates the prompt before echoing it
        echo = _echo_prefix(engine, reqs[0]) if body.echo else ""
        return sse_response(_completion_chunks(first, stream, rid, created, name,
                                               body.include_usage, echo, body.echo))
    outs = await until_disconnect(request, engine.generate_all(reqs))
    prefixes = [_echo_prefix(engine, r) if body.echo else "" for r in reqs]
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": created, "model": name,
        "choices": [{"index": i, "text": prefixes[i] + o.text,
                     "logprobs": completion_logprobs(o, 0, echo=body.echo),
                     "finish_reason": finish_reason(o), "matched_stop": (o.finish_reason or {}).get("matched")}
                    for i, o in enumerate(outs)],
        "usage": usage(outs),
    })


def _echo_prefix(engine: EngineCore, req: SingleReq) -> str:
    """The prompt as text; call only after the request was validated (ids in vocabulary)."""
    if req.text is not None:
        return req.text
    return engine.tokenizer.decode(req.input_ids or [])


async def _completion_chunks(first: GenerateOutput | None, rest: AsyncIterator[GenerateOutput],
                             rid: str, created: int, name: str, include_usage: bool,
                             echo: str, echo_logprobs: bool = False) -> AsyncIterator[dict[str, Any]]:
    def chunk(text: str, reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        out = {"id": rid, "object": "text_completion", "created": created, "model": name,
               "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
        if include_usage:
            out["usage"] = None
        return out

    try:
        offset = 0
        if echo:
            # the prompt's logprobs (echo) go with the echoed prompt
            prompt_lp = None
            if first is not None and first.logprobs is not None and echo_logprobs:
                prompt_lp = completion_logprobs(first, 0, 0, echo=True)
            yield chunk(echo, None, prompt_lp)
            offset = len(echo)
        out = first
        sent_logprobs = 0
        while out is not None:
            new_logprobs = out.logprobs is not None and out.num_logprobs_delta > 0
            if out.text_delta or out.finished or new_logprobs:
                logprobs = None
                if out.logprobs is not None:
                    logprobs = completion_logprobs(out, sent_logprobs, text_offset=offset)
                    sent_logprobs = len(out.logprobs["output_token_logprobs"])
                offset += len(out.text_delta)
                yield chunk(out.text_delta, finish_reason(out), logprobs)
            if out.finished:
                if include_usage:
                    yield {"id": rid, "object": "text_completion", "created": created, "model": name,
                           "choices": [], "usage": usage([out])}
                return
            out = await anext_or_none(rest)
    finally:
        await rest.aclose()


async def list_models(request: Request) -> Response:
    engine = engine_of(request)
    return JSONResponse({"object": "list", "data": [{
        "id": engine.model_name, "object": "model", "created": int(engine.start_time),
        "owned_by": "pyserve", "root": engine.model_path,
        "max_model_len": engine.context_len}]})


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
]
