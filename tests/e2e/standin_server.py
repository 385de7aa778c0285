"""The stand-in OpenAI-compatible server of test_bench_standin.py: fixed replies on a known
schedule (a first chunk after 300 ms, then chunks of 2, 1 and 2 tokens 100 ms apart). Prompts
containing FAIL get a 500 and prompts containing CUT a stream without [DONE].

Run as `python -m tests.e2e.standin_server PORT`: its own process, so the bench client's
tokenizer work (same GIL otherwise) cannot delay the designed schedule."""

from __future__ import annotations

import asyncio
import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

TTFT_S = 0.3
GAP_S = 0.1
# "Once upon a time there was" is 6 stories260k tokens: 1 + 2 + 1 + 2
CHUNKS = ["Once", " upon a", " time", " there was"]
NUM_OUTPUT = 6
PROMPT_TOKENS = 11  # what the stand-in reports as usage


def _body(kind: str, text: str | None, usage: dict | None) -> str:
    if kind == "chat":
        choices = [] if text is None else [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    else:
        choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": None}]
    return f"data: {json.dumps({'choices': choices, 'usage': usage})}\n\n"


def make_app() -> Starlette:
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "standin-model", "object": "model"}]})

    async def complete(request: Request, kind: str):  # type: ignore[no-untyped-def]
        body = await request.json()
        prompt = body["prompt"] if kind == "text" else body["messages"][0]["content"]
        assert body["model"] == "standin-model" and body["stream"] is True
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "no"}}, status_code=500)
        include_usage = (body.get("stream_options") or {}).get("include_usage", False)

        async def events():  # type: ignore[no-untyped-def]
            if kind == "chat":
                yield _body(kind, "", None)  # role-only chunk: no token
            await asyncio.sleep(TTFT_S)
            for i, text in enumerate(CHUNKS):
                if i:
                    await asyncio.sleep(GAP_S)
                yield _body(kind, text, None)
                if "CUT" in prompt and i == 1:
                    return
            if include_usage:
                yield _body(
                    kind,
                    None,
                    {
                        "prompt_tokens": PROMPT_TOKENS,
                        "completion_tokens": NUM_OUTPUT,
                        "total_tokens": PROMPT_TOKENS + NUM_OUTPUT,
                    },
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(request: Request):  # type: ignore[no-untyped-def]
        return await complete(request, "text")

    async def chat_completions(request: Request):  # type: ignore[no-untyped-def]
        return await complete(request, "chat")

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ]
    )


if __name__ == "__main__":
    uvicorn.run(make_app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
