"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Unknown fields are ignored, as the OpenAI API's clients send fields servers may not know.
Fields pyserve cannot honour yet (n > 1, tools, response_format, best_of) are refused with a
400 by `check_supported()` rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pyserve.errors import InvalidRequestError
from pyserve.io_struct import LogprobParams
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
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # extensions (SGLang / vLLM names)
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    # known OpenAI fields pyserve cannot honour yet: refused, not ignored
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        """Raise InvalidRequestError for fields pyserve cannot honour yet."""
        if self.n != 1:
            raise InvalidRequestError("only n=1 is supported", param="n")
        if self.tools:
            raise InvalidRequestError("'tools' is not supported yet", param="tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise InvalidRequestError("response_format other than text is not supported yet",
                                      param="response_format")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("only best_of=1 is supported", param="best_of")
        for key in self.logit_bias or {}:
            if not key.isdigit():
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                          param="logit_bias")

    def sampling_params(self, max_new_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens, seed=self.seed,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            min_new_tokens=self.min_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")

    def logprob_params(self) -> LogprobParams:
        return LogprobParams(return_logprob=self.logprobs, top_logprobs_num=self.top_logprobs or 0,
                             return_text_in_logprobs=True)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None

    def logprob_params(self) -> LogprobParams:
        """logprobs=k: the sampled token's logprob and the k most likely; with echo, the
        prompt tokens' too (the first one has none: null)."""
        if self.logprobs is None:
            return LogprobParams()
        return LogprobParams(return_logprob=True, top_logprobs_num=self.logprobs,
                             logprob_start_len=0 if self.echo else None, return_text_in_logprobs=True)

    def check_supported(self) -> None:
        super().check_supported()
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
