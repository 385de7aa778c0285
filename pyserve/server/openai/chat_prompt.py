"""The prompt of a request's chat messages (/v1/chat/completions, /v1/tokenize): the served chat
template rendered by the engine, with what the client and the log should learn from it.

* The template refusing the messages on purpose (`raise_exception`: "roles must alternate") is
  the request's fault: a 400 with the template's words and line, nothing logged.
* Any other error raised inside the template (an undefined name, a type error) may be the
  template's fault as much as the request's (a message without a field the template reads):
  still a 400, since a request written another way may render, but also a warning in the
  server's log naming the request and the template's line, so the operator can fix the
  template.
* A request with tools on a template that ignores them (the model never sees them) carries the
  header `x-pyserve-warning` (chat_template.TOOLS_IGNORED_WARNING); the body stays OpenAI's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pyserve.engine.engine_core import EngineCore
from pyserve.errors import InvalidRequestError
from pyserve.model_loader.chat_template import (
    TOOLS_IGNORED_WARNING,
    WARNING_HEADER,
    describe,
    ignores_tools,
    is_refusal,
    template_line,
    tools_template,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatPrompt:
    """text: the rendered prompt. headers: response headers the route adds (name -> value)."""

    text: str
    headers: dict[str, str] = field(default_factory=dict)


async def render_chat_prompt(engine: EngineCore, messages: list[dict[str, Any]], who: str, **kwargs: Any) -> ChatPrompt:
    """The prompt of `messages` (`kwargs`: apply_chat_template's, `tools` included) for the
    request `who` ("request <rid>": how the log names it). Raises InvalidRequestError (param "messages"): no chat
    template, or the template failed on these messages (see the module docstring). Loop
    thread."""
    try:
        text = await engine.apply_chat_template(messages, **kwargs)
    except InvalidRequestError as exc:
        cause = exc.__cause__
        if cause is None:
            raise
        if is_refusal(cause):
            raise InvalidRequestError(
                f"the chat template refused the messages: {describe(cause)}", param="messages"
            ) from cause
        if template_line(cause) is None:  # (raised by transformers around the template)
            raise
        logger.warning("%s: the chat template failed: %s", who, describe(cause))
        raise InvalidRequestError(f"the chat template failed: {describe(cause)}", param="messages") from cause
    headers = {}
    if kwargs.get("tools"):
        template = tools_template(engine.tokenizer)
        if template is not None and ignores_tools(template):
            headers[WARNING_HEADER] = TOOLS_IGNORED_WARNING
    return ChatPrompt(text, headers)
