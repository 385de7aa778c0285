"""Route handlers of the OpenAI-compatible API: chat completions, completions, models.

Responses follow the OpenAI API's shapes (ids, `object`, `created`, `usage` with
`prompt_tokens_details.cached_tokens`); streams send `chat.completion.chunk` /
`text_completion` deltas and end with `data: [DONE]`. With `n > 1` a choice per sample
(index = prompt index * n + sample), each finishing once; usage counts each prompt once.
Structured output and tool calls: a request's grammar (structured.py, tools.py) goes to the
engine in its SamplingParams, and the engine's refusal of it comes back as a 400 naming the
request field it came from; chat replies go through their ReplyPlan (chat_reply.py). The chat
prompt is chat_prompt.py's: a request with tools on a chat template that ignores them gets the
header `x-pyserve-warning`.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.engine.engine_core import EngineCore
from pyserve.errors import InvalidRequestError
from pyserve.io_struct import GenerateOutput, SingleReq, new_rid
from pyserve.model_loader.chat_template import tools_template
from pyserve.sampling_params import SamplingParams
from pyserve.server.context import engine_of
from pyserve.server.openai.chat_prompt import ChatPrompt, render_chat_prompt
from pyserve.server.openai.chat_reply import (
    ReplyPlan,
    chat_finish_reason,
    grammar_think,
    keeps_special_tokens,
    parse_reply,
    reply_plan,
    thinking_constraint,
)
from pyserve.server.openai.logprobs import chat_logprobs, completion_logprobs
from pyserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from pyserve.server.openai.stream_encoders import ChatStreamEncoder, CompletionStreamEncoder, finish_reason
from pyserve.server.openai.structured import (
    Constraint,
    rename_param,
)
from pyserve.server.render import SafeJSONResponse
from pyserve.server.request_body import parse_json
from pyserve.server.sse import until_disconnect
from pyserve.server.stream_hub import StreamResponse
from pyserve.server.stream_start import stream_response


def usage(outs: list[GenerateOutput], n: int = 1) -> dict[str, Any]:
    """Usage of final (or, streaming, latest) outputs: `outs` holds n samples per prompt in a
    row; each prompt counts once, with the cached tokens its samples found (the most any
    sample found)."""
    groups = [outs[i : i + n] for i in range(0, len(outs), n)]
    prompt = sum(g[0].prompt_tokens for g in groups)
    completion = sum(len(o.output_ids) for o in outs)
    cached = sum(max(o.cached_tokens for o in g) for g in groups)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def model_name(engine: EngineCore, requested: str | None) -> str:
    """See EngineCore.resolve_model (404 model_not_found for a model not served here)."""
    return engine.resolve_model(requested)


def _max_new_tokens(asked: int | None) -> int:
    """A request's output limit: what it asked for, else SamplingParams' default."""
    return asked if asked is not None else int(SamplingParams.model_fields["max_new_tokens"].default)


async def chat_completions(request: Request) -> Response | StreamResponse:
    body = ChatCompletionRequest.model_validate(await parse_json(request))
    body.check_supported()
    engine = engine_of(request)
    name = model_name(engine, body.model)
    req, prompt, plan, constraint = await chat_request(engine, body)
    rid = f"chatcmpl-{req.rid}"
    created = int(time.time())
    if body.stream:
        streamed = await stream_response(request, req, ChatStreamEncoder(body, rid, created, name, plan), constraint)
        if prompt.headers:
            streamed.headers = [*streamed.headers, *((k.encode(), v.encode()) for k, v in prompt.headers.items())]
        return streamed
    outs = await _generate_all(request, [req], constraint)
    choices = []
    for i, out in enumerate(outs):
        message, calls_made = (
            ({"role": "assistant", "content": out.text}, False) if plan is None else parse_reply(plan, out.text)
        )
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(out, 0),
                "finish_reason": chat_finish_reason(out, calls_made),
                "matched_stop": out.finish_reason.matched if out.finish_reason else None,
            }
        )
    return SafeJSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": usage(outs, body.n),
        },
        headers=prompt.headers,
    )


async def chat_request(
    engine: EngineCore, body: ChatCompletionRequest
) -> tuple[SingleReq, ChatPrompt, ReplyPlan | None, Constraint | None]:
    """What /v1/chat/completions runs for `body` (checked by `check_supported`), also the
    Python Engine's `chat`: its request, its rendered prompt, the parsers of its reply and its
    grammar. Raises InvalidRequestError (an embedding model, tools without a parser, a chat
    template refusing the messages). Loop thread."""
    if not engine.is_generation:  # (before the template: an encoder's tokenizer usually has none)
        raise InvalidRequestError(
            "this server serves an embedding model: it answers /v1/embeddings and /encode, not chat completions",
            param="model",
        )
    args = engine.server_args
    plan = reply_plan(body, args.tool_call_parser, args.reasoning_parser, tools_template(engine.tokenizer))
    constraint = thinking_constraint(body, args.reasoning_parser, body.constraint())
    base_rid = body.rid or new_rid()
    prompt = await render_chat_prompt(
        engine, [m.to_template() for m in body.messages], f"request {base_rid}", **body.template_kwargs()
    )
    req = SingleReq(
        text=prompt.text,
        input_ids=None,
        sampling_params=body.sampling_params(body.max_new_tokens, constraint, keeps_special_tokens(plan, body)),
        stream=body.stream,
        add_special_tokens=body.add_special_tokens,
        logprob=body.logprob_params(),
        rid=base_rid,
        priority=body.priority,
        grammar_think=grammar_think(
            body, args.reasoning_parser, constraint is not None, _max_new_tokens(body.max_new_tokens)
        ),
    )
    return req, prompt, plan, constraint


async def _generate_all(request: Request, reqs: list[SingleReq], constraint: Constraint | None) -> list[GenerateOutput]:
    """Final outputs of non-streamed `reqs` (engine.generate_all, aborted if the client
    leaves); the engine's refusal of the grammar names the request field it came from."""
    try:
        return await until_disconnect(request, engine_of(request).generate_all(reqs))
    except InvalidRequestError as exc:
        raise rename_param(exc, constraint) from None


async def completions(request: Request) -> Response | StreamResponse:
    body = CompletionRequest.model_validate(await parse_json(request))
    body.check_supported()
    engine = engine_of(request)
    name = model_name(engine, body.model)
    constraint = body.constraint()
    base_rid = body.rid or new_rid()
    prompts = body.prompts()
    reqs = [
        SingleReq(
            text=text,
            input_ids=ids,
            sampling_params=body.sampling_params(body.max_tokens, constraint),
            stream=body.stream,
            logprob=body.logprob_params(),
            add_special_tokens=body.add_special_tokens,
            rid=base_rid if len(prompts) == 1 else f"{base_rid}-p{k}",
            parent_rid=None if len(prompts) == 1 else base_rid,
            priority=body.priority,
        )
        for k, (text, ids) in enumerate(prompts)
    ]
    rid = f"cmpl-{base_rid}"
    created = int(time.time())
    if body.stream:  # (one prompt: check_supported)
        if body.echo:  # a prompt is echoed only once it was found valid
            await engine.check_prompt(reqs[0])
        echo = await _echo(engine, reqs[0], body)
        return await stream_response(
            request, reqs[0], CompletionStreamEncoder(body, rid, created, name, echo), constraint
        )
    outs = await _generate_all(request, reqs, constraint)
    echoes = [await _echo(engine, r, body) for r in reqs]
    choices = []
    for i, o in enumerate(outs):
        prefix, prompt_offsets = echoes[i // body.n]
        choices.append(
            {
                "index": i,
                "text": prefix + o.text,
                "logprobs": completion_logprobs(
                    o, 0, echo=body.echo, text_offset=len(prefix), prompt_offsets=prompt_offsets
                ),
                "finish_reason": finish_reason(o),
                "matched_stop": o.finish_reason.matched if o.finish_reason else None,
            }
        )
    return SafeJSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": choices,
            "usage": usage(outs, body.n),
        }
    )


async def _echo(engine: EngineCore, req: SingleReq, body: CompletionRequest) -> tuple[str, list[int] | None]:
    """The echoed prompt text ("" without echo) and, with logprobs, its tokens' offsets."""
    if not body.echo:
        return "", None
    if body.logprobs is None:
        return await engine.prompt_text(req), None
    return await engine.prompt_text_offsets(req)


def _model_card(engine: EngineCore, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(engine.start_time),
        "owned_by": "pyserve",
        "root": engine.model_path,
        "max_model_len": engine.context_len,
        "is_generation": engine.is_generation,  # (false: an embedding model, /v1/embeddings)
    }


async def list_models(request: Request) -> Response:
    """GET /v1/models: a card per --served-model-name (vLLM lists every name), the first the
    name responses carry; one card of the model's name without the flag."""
    engine = engine_of(request)
    names = engine.server_args.served_model_name or [engine.model_name]
    return SafeJSONResponse({"object": "list", "data": [_model_card(engine, name) for name in names]})


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{id}: the served model under any name the routes accept, else 404."""
    engine = engine_of(request)
    model_id = request.path_params["model_id"]
    model_name(engine, model_id)
    listed = engine.server_args.served_model_name or []
    return SafeJSONResponse(_model_card(engine, model_id if model_id in listed else engine.model_name))


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
]
