"""POST /v1/responses: the OpenAI Responses API, streamed or not, over the chat path.

`instructions` (a system message) and `input` (a string: one user message; or a list of
messages whose content is a string or `input_text` / `output_text` parts, `developer` read as
`system`) go through the chat template, and the prompt is generated from as a chat completion
is: the same prompt, sampling and token counts as /v1/chat/completions with those messages.
`text.format` `json_object` / `json_schema` becomes the request's grammar (structured.py).
The request body is responses_protocol.py's; the response objects and stream events are
responses_stream.py's.

Nothing is stored: `store: true`, `previous_response_id`, `conversation`, `background` and
the routes of stored responses (`/v1/responses/{id}`...) are 400 "not supported". Fields that
would change the output and that pyserve cannot honour (tools, reasoning, include,
top_logprobs, truncation "auto", images and files, other input items than messages) are 400s
naming the field; unknown fields are 400s as on the other OpenAI routes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.engine.end_cause import end_error
from pyserve.errors import InvalidRequestError
from pyserve.io_struct import GenerateOutput, SingleReq
from pyserve.server.context import engine_of
from pyserve.server.openai.responses_protocol import ResponsesRequest, check_input_items
from pyserve.server.openai.responses_stream import ResponseHead, ResponsesStreamEncoder, final_response
from pyserve.server.openai.structured import rename_param
from pyserve.server.render import SafeJSONResponse
from pyserve.server.request_body import parse_json
from pyserve.server.sse import until_disconnect
from pyserve.server.stream_hub import Stream, StreamResponse
from pyserve.server.stream_start import stream_response


async def create_response(request: Request) -> Response | StreamResponse:
    """POST /v1/responses: the Response object, or with `stream` its SSE events. Raises
    InvalidRequestError / ValidationError (400s naming the field; 404 for another model)."""
    data = await parse_json(request)
    check_input_items(data)
    body = ResponsesRequest.model_validate(data)
    body.check_supported()
    engine = engine_of(request)
    name = engine.resolve_model(body.model)
    if not engine.is_generation:  # (before the template: an encoder's tokenizer usually has none)
        raise InvalidRequestError(
            "this server serves an embedding model: it answers /v1/embeddings and /encode, not responses",
            param="model",
        )
    constraint = body.constraint()
    try:
        prompt = await engine.apply_chat_template(body.messages())
    except InvalidRequestError as exc:
        if exc.param == "messages":  # (the chat route's name of what is `input` here)
            exc.param = "input"
        raise
    req = SingleReq(
        text=prompt,
        input_ids=None,
        sampling_params=body.sampling_params(constraint),
        stream=body.stream,
        add_special_tokens=False,  # as the chat route: the template has the special tokens
    )
    head = ResponseHead(f"resp_{req.rid}", f"msg_{req.rid}", int(time.time()), name, body.echo())
    if body.stream:
        encode = ResponsesStreamEncoder(head)
        return await stream_response(request, req, encode, constraint, _responses_output(encode))
    try:
        outs = await until_disconnect(request, engine.generate_all([req]))
    except InvalidRequestError as exc:
        raise rename_param(exc, constraint) from None
    return SafeJSONResponse(final_response(head, outs[0]))


def _responses_output(encode: ResponsesStreamEncoder) -> Callable[[Stream, GenerateOutput], None]:
    """How a Responses stream takes each output: one failing after the first event ends with
    `response.failed` (the encoder's), not the chat routes' error event; a request refused
    before it is a plain error response, as on the other routes."""

    def take(stream: Stream, out: GenerateOutput) -> None:
        failure = end_error(out.finish_reason, streamed=True)
        if failure is not None and encode.started:
            encode.fail(failure)
            stream.end()
        else:
            stream.push(out)

    return take


async def stored_response(request: Request) -> Response:
    """GET / DELETE /v1/responses/{id}, its cancel and input_items: nothing is stored."""
    raise InvalidRequestError(
        "stored responses are not supported: pyserve stores no responses (store is always false)",
        param="response_id",
    )


ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id:path}", stored_response, methods=["GET", "POST", "DELETE"]),
]
