"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to SamplingParams.

Every field a request may carry is declared: OpenAI's own, and SGLang's and vLLM's extensions.
A field nobody declared gets a 400 ("Unrecognized request argument", as the OpenAI API
answers), so nothing that could change the output is ignored silently. Harmless metadata
(`user`, `metadata`, `store`, `service_tier`, ...) is accepted. Fields naming a feature
pyserve does not have yet (structured output, tools, beam search, ...) are accepted at their
default and refused with a 400 naming them otherwise (`check_supported()`). Structured output
fields become one grammar (structured.py); `tools` and `tool_choice` are tools.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pyserve.errors import InvalidRequestError
from pyserve.io_struct import LogprobParams, is_unset
from pyserve.sampling_params import INT64_MAX, MAX_N, SamplingParams
from pyserve.server.openai.structured import (
    GRAMMAR_FIELDS,
    Constraint,
    field_constraints,
    one_constraint,
    response_format_constraint,
)
from pyserve.server.openai.tools import (
    MessageToolCall,
    Tool,
    ToolChoice,
    ToolMode,
    check_tools,
    forced_constraint,
    template_tools,
    tool_mode,
)


def null_means_default(model: type[BaseModel], data: Any) -> Any:
    """A request body with its null fields dropped where the field's default is not null
    (OpenAI's fields are nullable: null stands for the default); the `mode="before"`
    validator of every OpenAI request model."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}


STRICT = ConfigDict(extra="forbid", strict=True)

# Fields accepted only at their default (null, false, an empty list), with what they would ask.
UNSUPPORTED = {
    "guided_whitespace_pattern": "guided_whitespace_pattern (see --constrained-json-disable-any-whitespace) is",
    "functions": "functions (the deprecated form of tools) is",
    "function_call": "function_call (the deprecated form of tool_choice) is",
    "suffix": "suffix (fill-in-the-middle) is",
    "use_beam_search": "beam search is",
    "prompt_logprobs": "prompt_logprobs (use echo with logprobs) is",
    "allowed_token_ids": "allowed_token_ids is",
    "bad_words": "bad_words is",
    "truncate_prompt_tokens": "prompt truncation is",
    "lora_path": "LoRA adapters are",
    "session_params": "sessions are",
    "bootstrap_host": "prefill/decode disaggregation is",
    "bootstrap_port": "prefill/decode disaggregation is",
    "bootstrap_room": "prefill/decode disaggregation is",
    "return_hidden_states": "returning hidden states is",
    "audio": "audio output is",
    "prediction": "predicted outputs are",
    "web_search_options": "web search is",
    "reasoning_effort": "reasoning_effort (this server's models do not reason) is",
    "chat_template": "a per-request chat_template is",
    "documents": "documents are",
    "mm_processor_kwargs": "multimodal inputs are",
    "logits_processors": "custom logits processors are",
}


# arguments of apply_chat_template itself (or features refused above): not chat_template_kwargs
TEMPLATE_ARGUMENTS = frozenset(
    "conversation messages tokenize add_generation_prompt continue_final_message return_dict chat_template tools "
    "documents tokenizer_kwargs return_assistant_tokens_mask padding truncation max_length return_tensors".split()
)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels: harmless


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. An assistant message may carry `tool_calls` (its content then may be
    null), a `tool` message the `tool_call_id` it answers. Other fields are passed to the chat
    template as they are, which renders those it knows."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' convention: a tool call's
        arguments as a dict)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.to_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        out.update(self.model_extra or {})
        return out


class _Common(BaseModel):
    """Fields shared by chat and text completions (OpenAI's plus SGLang's and vLLM's)."""

    model_config = STRICT

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: dict[str, Any] | None = None
    # harmless metadata: accepted, does not change the output
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    rid: str | None = None
    request_id: str | None = None
    priority: int | None = None  # vLLM: scheduling only
    guided_decoding_backend: str | None = None  # vLLM: which grammar engine, not a grammar
    # extensions (SGLang / vLLM names)
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    include_stop_str_in_output: bool = False
    stream_interval: int | None = Field(default=None, ge=1)
    length_penalty: float = 1.0
    # structured output (structured.py): SGLang's and vLLM's fields
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    structural_tag: str | dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted at their default only (UNSUPPORTED)
    guided_whitespace_pattern: Any = None
    use_beam_search: Any = False
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    lora_path: Any = None
    session_params: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    return_hidden_states: Any = False
    logits_processors: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        return null_means_default(cls, data)

    def check_supported(self) -> None:
        """Raise InvalidRequestError (400, `param` naming the field) for a field set to
        something pyserve cannot honour yet."""
        for name, feature in UNSUPPORTED.items():
            if name in type(self).model_fields and not is_unset(getattr(self, name)):
                raise InvalidRequestError(f"{name}: {feature} not supported yet; leave it unset", param=name)
        if not self.spaces_between_special_tokens:
            raise InvalidRequestError(
                "spaces_between_special_tokens: only true is supported", param="spaces_between_special_tokens"
            )
        if self.length_penalty != 1.0:
            raise InvalidRequestError("length_penalty: beam search is not supported yet", param="length_penalty")
        for key in self.logit_bias or {}:
            if not key.isdigit():
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")

    def constraints(self) -> list[Constraint]:
        """The grammars the request's structured-output fields ask for (InvalidRequestError
        for a malformed response_format or guided_choice)."""
        rf = response_format_constraint(self.response_format)
        fields = field_constraints({name: getattr(self, name) for name in GRAMMAR_FIELDS})
        return ([rf] if rf is not None else []) + fields

    def constraint(self) -> Constraint | None:
        """The request's one grammar, or None (InvalidRequestError naming the second field
        when several ask for one)."""
        return one_constraint(self.constraints())

    def sampling_params(
        self,
        max_new_tokens: int | None,
        constraint: Constraint | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams; `constraint` sets its grammar field,
        `skip_special_tokens` (when not None) overrides the request's."""
        sp = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
            seed=self.seed,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            min_new_tokens=self.min_tokens,
            n=self.n,
            stream_interval=self.stream_interval,
            no_stop_trim=self.no_stop_trim or self.include_stop_str_in_output,
        )
        # (one grammar field at most: the constraint is the request's only one)
        return sp if constraint is None else sp.model_copy(update={constraint.kind: constraint.text})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (SGLang's and vLLM's option)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None
    # chat templating (vLLM / SGLang names)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # tokens the model may think at most before its answer (with --reasoning-parser); a
    # request with a grammar gets half its max_tokens when it gives none
    thinking_budget: int | None = Field(default=None, ge=0)
    # accepted at their default only (UNSUPPORTED)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    chat_template: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        check_tools(self.tools, self.tool_choice)
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequestError(
                    "continue_final_message needs add_generation_prompt=false", param="continue_final_message"
                )
            if self.messages[-1].role != "assistant":
                raise InvalidRequestError(
                    "continue_final_message needs an assistant message last", param="continue_final_message"
                )
        clash = TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or {})
        if clash:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {sorted(clash)[0]!r}", param="chat_template_kwargs"
            )

    @property
    def tool_mode(self) -> ToolMode:
        """See tools.tool_mode."""
        return tool_mode(self.tools, self.tool_choice)

    @property
    def max_calls(self) -> int | None:
        """Calls a reply may make at most (parallel_tool_calls false: 1), None: any number."""
        return 1 if self.parallel_tool_calls is False else None

    def constraint(self) -> Constraint | None:
        """The request's one grammar (see _Common.constraint), a forced tool call's included."""
        forced = forced_constraint(self.tools, self.tool_choice, self.max_calls)
        return one_constraint(self.constraints() + ([forced] if forced is not None else []))

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `tokenizer.apply_chat_template` for this request (`tools`
        when the reply may call them)."""
        out = {
            **(self.chat_template_kwargs or {}),
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }
        if self.tool_mode != "none":
            assert self.tools is not None
            out["tools"] = template_tools(self.tools)
        return out

    def logprob_params(self) -> LogprobParams:
        return LogprobParams(
            return_logprob=self.logprobs, top_logprobs_num=self.top_logprobs or 0, return_text_in_logprobs=True
        )

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True
    suffix: Any = None

    def logprob_params(self) -> LogprobParams:
        """logprobs=k: the sampled token's logprob and the k most likely; with echo, the
        prompt tokens' too (the first one has none: null)."""
        if self.logprobs is None:
            return LogprobParams()
        return LogprobParams(
            return_logprob=True,
            top_logprobs_num=self.logprobs,
            logprob_start_len=0 if self.echo else None,
            return_text_in_logprobs=True,
        )

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                f"best_of must equal n ({self.n}): choosing the best of more samples is not supported yet",
                param="best_of",
            )
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if (
            self.stream
            and isinstance(self.prompt, list)
            and self.prompt
            and isinstance(self.prompt[0], (str, list))
            and len(self.prompt) > 1
        ):
            raise InvalidRequestError("stream=true takes a single prompt", param="prompt")

    def prompts(self) -> list[tuple[str | None, list[int] | None]]:
        """(text, ids) per prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [(p, None)]
        if p and isinstance(p[0], int):
            return [(None, list(p))]  # one prompt of ids
        out: list[tuple[str | None, list[int] | None]] = []
        for x in p:
            if isinstance(x, str):
                out.append((x, None))
            else:
                out.append((None, list(cast("list[int]", x))))
        return out
