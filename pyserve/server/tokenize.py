"""`/v1/tokenize` and `/v1/detokenize` (also `/tokenize`, `/detokenize`), in SGLang's shapes:
the served tokenizer's ids of a prompt (or of chat messages, with `tools`, as the chat route
renders them: `return_text` shows the rendered prompt) and the text of ids."""

from __future__ import annotations

from typing import Any, cast

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.errors import InvalidRequestError
from pyserve.server.context import engine_of
from pyserve.server.openai.chat_prompt import render_chat_prompt
from pyserve.server.openai.protocol import STRICT, TEMPLATE_ARGUMENTS, ChatMessage
from pyserve.server.openai.tools import Tool, check_tools, template_tools
from pyserve.server.render import SafeJSONResponse
from pyserve.server.request_body import parse_json


class TokenizeRequest(BaseModel):
    """`prompt` (a string or a list of them) or chat `messages`, one of the two.
    add_special_tokens: default true for a prompt (as /v1/completions), false for messages
    (as /v1/chat/completions: the template writes them). With messages, `tools`,
    `add_generation_prompt` and `chat_template_kwargs` go to the chat template as on the chat
    route (`tools` as with tool_choice auto). return_text: the reply also gives the text the
    ids are of (the rendered prompt, for messages)."""

    model_config = STRICT
    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_text: bool = False

    def check(self) -> None:
        """InvalidRequestError for prompt and messages both or neither, tools without
        messages or sharing a name, or chat_template_kwargs setting an argument of the
        template call itself."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give either prompt or messages", param="prompt")
        if self.tools is not None and self.messages is None:
            raise InvalidRequestError("tools go with messages (a chat prompt), not with prompt", param="tools")
        check_tools(self.tools, None)
        clash = TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or {})
        if clash:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {sorted(clash)[0]!r}", param="chat_template_kwargs"
            )

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `tokenizer.apply_chat_template`, as the chat route's."""
        out = {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt}
        if self.tools:
            out["tools"] = template_tools(self.tools)
        return out


class DetokenizeRequest(BaseModel):
    """`tokens`: one id list or a list of them."""

    model_config = STRICT
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False


async def tokenize(request: Request) -> Response:
    """{"tokens": ids, "count": len(ids), "max_model_len": context length} (and "text" with
    return_text); for a list of prompts, a list of id lists, of counts (and of texts). With
    tools on a chat template that ignores them, the x-pyserve-warning header (chat_prompt.py).
    Raises InvalidRequestError (400s naming the field)."""
    body = TokenizeRequest.model_validate(await parse_json(request))
    engine = engine_of(request)
    engine.resolve_model(body.model)
    body.check()
    headers: dict[str, str] = {}
    text: str | list[str]
    if body.messages is not None:
        prompt = await render_chat_prompt(
            engine, [m.to_template() for m in body.messages], "a /v1/tokenize request", **body.template_kwargs()
        )
        text, headers = prompt.text, prompt.headers
        special = bool(body.add_special_tokens)
        ids: list[int] | list[list[int]] = (await engine.encode_text(text, special)).tolist()
        count: int | list[int] = len(ids)
    else:
        special = body.add_special_tokens is not False
        if isinstance(body.prompt, list):
            limit = engine.server_args.max_prompts_per_request
            if len(body.prompt) > limit:
                raise InvalidRequestError(
                    f"{len(body.prompt)} prompts; at most {limit} are allowed (--max-prompts-per-request)",
                    param="prompt",
                )
            each: list[list[int]] = [(await engine.encode_text(p, special)).tolist() for p in body.prompt]
            ids, count, text = each, [len(i) for i in each], body.prompt
        else:
            text = body.prompt or ""
            ids = (await engine.encode_text(text, special)).tolist()
            count = len(ids)
    reply: dict[str, Any] = {"tokens": ids, "count": count, "max_model_len": engine.context_len}
    if body.return_text:
        reply["text"] = text
    return SafeJSONResponse(reply, headers=headers)


async def detokenize(request: Request) -> Response:
    """{"text": the ids' text} (a list of texts for a list of id lists). Raises
    InvalidRequestError (param "tokens") for an id outside the tokenizer's vocabulary."""
    body = DetokenizeRequest.model_validate(await parse_json(request))
    engine = engine_of(request)
    engine.resolve_model(body.model)
    tokenizer = engine.tokenizer
    batch = body.tokens and isinstance(body.tokens[0], list)
    seqs = cast(list[list[int]], body.tokens if batch else [body.tokens])
    size = len(tokenizer)
    for i, seq in enumerate(seqs):
        bad = next((t for t in seq if not 0 <= t < size), None)
        if bad is not None:
            where = f"tokens.{i}" if batch else "tokens"
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0..{size - 1})", param=where)
    texts = await engine.decode_ids(seqs, body.skip_special_tokens)
    return SafeJSONResponse({"text": texts if batch else texts[0]})


ROUTES = [
    Route("/v1/tokenize", tokenize, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/v1/detokenize", detokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
