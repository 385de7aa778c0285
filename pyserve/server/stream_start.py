"""`stream_response`: how every streaming route starts a request's stream (/generate,
/v1/completions, /v1/chat/completions, /v1/responses), so each is tokenized, refused, ended
and paused alike."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from pyserve.io_struct import GenerateOutput, SingleReq
from pyserve.server.context import context_of
from pyserve.server.openai.structured import Constraint, renamed_output, renamed_outputs, tokenize_to_start
from pyserve.server.stream_hub import Stream, StreamEncoder, StreamResponse, outputs_response


async def stream_response(
    request: Request,
    req: SingleReq,
    encode: StreamEncoder,
    constraint: Constraint | None = None,
    on_output: Callable[[Stream, GenerateOutput], None] | None = None,
) -> StreamResponse:
    """The streamed response of `req` through the app's StreamHub, its events made by `encode`.

    `req` is tokenized and admitted before the 200 goes out: a refusal (invalid, queue full,
    a grammar the backend rejects) raises here, as an error response. n > 1 requests are
    validated at their first step (an error response then). `constraint`: the structured
    output field, which a grammar failure is named by. `on_output(stream, out)`: takes each
    output instead of `stream.push` (the Responses API ends a failed stream its own way).
    The client leaving forgets the request (nothing more is made for it); a slow client
    pauses it. Raises ModelLoadingError / ServerDrainingError (503) as `engine_of`."""
    ctx = context_of(request)
    engine = ctx.serving_engine()
    if req.sampling_params.n > 1:
        outputs: AsyncIterator[GenerateOutput] = engine.generate(req)
        if constraint is not None:
            outputs = renamed_outputs(outputs, constraint)
        return outputs_response(ctx.stream_hub, encode, outputs)
    treq = await tokenize_to_start(engine, req, constraint)

    def start(stream: Stream) -> None:
        sink: Callable[[GenerateOutput], None]
        if on_output is not None:
            sink = lambda out: on_output(stream, renamed_output(out, constraint))  # noqa: E731
        elif constraint is not None:
            sink = lambda out: stream.push(renamed_output(out, constraint))  # noqa: E731
        else:
            sink = stream.push
        engine.start_stream(req, treq, sink)

    return StreamResponse(
        ctx.stream_hub,
        encode,
        start,
        lambda: engine.forget(req.rid),
        lambda paused: engine.pause(req.rid, paused),
    )
