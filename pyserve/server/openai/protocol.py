"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Unknown fields are ignored, as the OpenAI API's clients send fields servers may not know.
Fields pyserve cannot honour yet (n > 1, logprobs, penalties, tools, logit_bias,
response_format, best_of) are refused with a 400 by
`check_supported()` rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pyserve.errors import InvalidRequestError
from pyserve.sampling_params import SamplingParams


STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        return out


class _Common(BaseModel):
    """Fields shared by chat and text completions (OpenAI's plus SGLang's extensions)."""

    model_config = STRICT

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # extensions (SGLang / vLLM names)
    top_k: int = -1
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    # known OpenAI fields pyserve cannot honour yet: refused, not ignored
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        """Raise InvalidRequestError for fields pyserve cannot honour yet."""
        if self.n != 1:
            raise InvalidRequestError("only n=1 is supported", param="n")
        for name in ("tools", "logit_bias"):
            if getattr(self, name):
                raise InvalidRequestError(f"'{name}' is not supported yet", param=name)
        if self.response_format and self.response_format.get("type") != "text":
            raise InvalidRequestError("response_format other than text is not supported yet",
                                      param="response_format")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("only best_of=1 is supported", param="best_of")
        if self.presence_penalty or self.frequency_penalty:
            raise InvalidRequestError("presence/frequency penalties are not supported yet",
                                      param="presence_penalty" if self.presence_penalty else "frequency_penalty")

    def sampling_params(self, max_new_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens, seed=self.seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise InvalidRequestError("logprobs are not supported yet", param="logprobs")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise InvalidRequestError("logprobs are not supported yet", param="logprobs")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if self.stream and isinstance(self.prompt, list) and self.prompt and \
                isinstance(self.prompt[0], (str, list)) and len(self.prompt) > 1:
            raise InvalidRequestError("stream=true takes a single prompt", param="prompt")

    def prompts(self) -> list[tuple[str | None, list[int] | None]]:
        """(text, ids) per prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [(p, None)]
        if p and isinstance(p[0], int):
            return [(None, list(p))]  # type: ignore[arg-type]
        return [(x, None) if isinstance(x, str) else (None, list(x)) for x in p]  # type: ignore[union-attr]
