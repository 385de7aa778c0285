"""The request body of POST /v1/responses (pydantic, strict) and its mapping to the chat path.

OpenAI's fields plus SGLang's sampling extensions (top_k, min_p, repetition_penalty,
frequency_penalty, presence_penalty, stop, seed). A field nobody declared is a 400
("Unrecognized request argument", as on the other OpenAI routes); harmless metadata is
accepted; settings pyserve cannot honour are declared and refused unless left unset
(`check_supported`, a 400 naming the field). Input items other than messages, and content
parts other than text, are refused before validation (`check_input_items`) so that the 400
says what is unsupported rather than what is malformed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from pyserve.errors import InvalidRequestError
from pyserve.io_struct import is_unset
from pyserve.sampling_params import SamplingParams
from pyserve.server.openai.protocol import STRICT, null_means_default
from pyserve.server.openai.structured import Constraint, json_text

# Fields refused unless left unset (null, false, empty), with why.
REFUSED = {
    "previous_response_id": "previous_response_id is not supported: pyserve stores no responses; "
    "send the conversation so far as input",
    "conversation": "conversation is not supported: pyserve stores no conversations; "
    "send the conversation so far as input",
    "store": "store: true is not supported: pyserve stores no responses; leave store unset or false",
    "background": "background: true is not supported",
    "tools": "tools are not supported on /v1/responses yet (use /v1/chat/completions)",
    "include": "include is not supported (no extra output data)",
    "prompt": "prompt (a stored prompt template) is not supported; send the text as input",
    "context_management": "context_management is not supported",
}
# the content part types of input messages (anything else, images or files, is refused)
TEXT_PART_TYPES = ("input_text", "output_text")


def _text_or_list(value: Any) -> str:
    # (a tag, not both union branches: a malformed list is reported without the string
    # branch's "should be a valid string"; capitalized, the tag stays out of error paths)
    return "Text" if isinstance(value, str) else "List"


class TextPart(BaseModel):
    """A text content part: `input_text`, or `output_text` as an earlier response's output
    item carries it (with its annotations and logprobs, which change nothing here)."""

    model_config = STRICT
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(BaseModel):
    """A message of `input`; an earlier response's output item (with its id and status) is one."""

    model_config = STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[
        Annotated[str, Tag("Text")] | Annotated[list[TextPart], Tag("List")],
        Discriminator(_text_or_list),
    ]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def to_template(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(BaseModel):
    model_config = STRICT
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels: harmless


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses: OpenAI's fields, and SGLang's sampling extensions."""

    model_config = STRICT

    model: str | None = None
    input: Annotated[
        Annotated[str, Tag("Text")] | Annotated[list[InputMessage], Tag("List")], Discriminator(_text_or_list)
    ]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    text: TextConfig | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning: dict[str, Any] | None = None
    # harmless metadata: accepted, does not change the output
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # SGLang's sampling extensions
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    # accepted unset only (REFUSED)
    previous_response_id: str | None = None
    conversation: Any = None
    store: bool | None = None
    background: bool | None = None
    tools: list[Any] | None = None
    include: list[Any] | None = None
    prompt: Any = None
    context_management: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        return null_means_default(cls, data)

    def check_supported(self) -> None:
        """Raise InvalidRequestError (400, `param` naming the field) for a setting pyserve
        cannot honour."""
        for name, why in REFUSED.items():
            if not is_unset(getattr(self, name)):
                raise InvalidRequestError(why, param=name)
        if self.tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice: tools are not supported on /v1/responses yet", param="tool_choice")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise InvalidRequestError(
                "reasoning: this server's models do not reason; leave it unset", param="reasoning"
            )
        if self.top_logprobs:
            raise InvalidRequestError(
                "top_logprobs: logprobs are not supported on /v1/responses yet", param="top_logprobs"
            )
        if self.truncation == "auto":
            raise InvalidRequestError(
                'truncation "auto" is not supported: a prompt longer than the context is a 400', param="truncation"
            )
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise InvalidRequestError("text.verbosity: only medium (the default) is supported", param="text.verbosity")
        if isinstance(self.input, list) and not self.input:
            raise InvalidRequestError("input is empty", param="input")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            takes = {
                "text": set(),
                "json_object": set(),
                "json_schema": {"name", "json_schema", "description", "strict"},
            }
            extra = sorted(k for k in fmt.model_fields_set - {"type"} if k not in takes[fmt.type])
            if extra:
                field = "schema" if extra[0] == "json_schema" else extra[0]
                raise InvalidRequestError(
                    f"text.format of type {fmt.type} takes no field {field!r}", param=f"text.format.{field}"
                )
            if fmt.type == "json_schema" and fmt.json_schema is None:
                raise InvalidRequestError(
                    "text.format of type json_schema needs its schema (a JSON Schema object)",
                    param="text.format.schema",
                )

    def constraint(self) -> Constraint | None:
        """The grammar `text.format` asks for (None: plain text)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint("json_schema", '{"type": "object"}', "text.format")
        assert fmt.json_schema is not None  # (check_supported)
        return Constraint("json_schema", json_text(fmt.json_schema, "text.format"), "text.format")

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages the prompt is rendered from: the instructions as a system
        message, then the input."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        return out + [m.to_template() for m in self.input]

    def sampling_params(self, constraint: Constraint | None) -> SamplingParams:
        """The engine's SamplingParams (ValidationError, a 400, for values it refuses);
        `constraint` sets its grammar field."""
        sp = SamplingParams(
            max_new_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=self.stop,
            seed=self.seed,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
        )
        return sp if constraint is None else sp.model_copy(update={constraint.kind: constraint.text})

    def echo(self) -> dict[str, Any]:
        """The settings a Response object repeats, in its field names."""
        fmt = self.text.format if self.text is not None else None
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "prompt_cache_key": self.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": self.safety_identifier,
            "service_tier": "default",
            "temperature": self.temperature,
            "text": {
                "format": {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True),
                "verbosity": "medium",
            },
            "tool_choice": self.tool_choice or "auto",
            "tools": [],
            "top_logprobs": 0,
            "top_p": self.top_p,
            "truncation": "disabled",
            "user": self.user,
        }


def check_input_items(data: Any) -> None:
    """Refuse (400 naming the item or part) the input items pyserve cannot read before the
    strict validation would call them malformed: items other than messages (function calls,
    reasoning, item references) and content parts other than text (images, files, audio)."""
    items = data.get("input") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind != "message":
            raise InvalidRequestError(
                f"input.{i}: items of type {kind!r} are not supported (messages only)", param=f"input.{i}.type"
            )
        content = item.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") not in TEXT_PART_TYPES:
                raise InvalidRequestError(
                    f"input.{i}.content.{j}: content parts of type {part.get('type')!r} are not supported "
                    "(input_text and output_text only)",
                    param=f"input.{i}.content.{j}.type",
                )
