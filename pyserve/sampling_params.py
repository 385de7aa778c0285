"""Per-request sampling parameters of the native API (`sampling_params` of /generate)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Temperatures below this sample greedily (SGLang uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5
# Parallel samples per prompt at most (OpenAI's limit for n is 128).
MAX_N = 128

# the largest int64 (the dtype of the worker's integer sampling rows)
INT64_MAX = 2**63 - 1
# the largest finite float32 (the dtype of the worker's sampling rows)
FLOAT32_MAX = 3.4028234663852886e38

# the structured-output fields, one of which may name the request's grammar
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class SamplingParams(BaseModel):
    """How to sample one request's output. Validation errors become HTTP 400.

    max_new_tokens: output tokens at most (0 returns at once with no output); None means
        "up to the context length".
    temperature:    0 means greedy; > 0 scales logits before sampling (below
                    GREEDY_TEMPERATURE it is treated as greedy: dividing by it overflows).
    top_p:          nucleus mass in (0, 1].
    top_k:          keep the k most likely tokens; -1 or 0 means all.
    min_p:          drop tokens less likely than min_p times the most likely one (0: off).
    frequency_penalty, presence_penalty: in [-2, 2], OpenAI semantics over the output so far.
    repetition_penalty: > 0 (1: off), CTRL-style over prompt and output tokens.
    logit_bias:     {"token id": bias} added to the logits (a JSON object's keys are strings);
                    -inf bans the token, +inf and NaN are refused.
    min_new_tokens: stop tokens (EOS and stop_token_ids) are masked until this many tokens.
    stop:           strings that end the output; the matched string is not part of the text.
    stop_token_ids: token ids that end the output (in addition to the model's EOS).
    ignore_eos:     keep going past EOS (benchmarks).
    skip_special_tokens: drop special tokens from the text.
    seed:           makes a sampled (temperature > 0) request reproducible.
    n:              parallel samples of the prompt (prefilled once; see README "n > 1").
    no_stop_trim:   keep the matched stop string or stop token's text in the output (SGLang's
                    name; the OpenAI routes also take vLLM's `include_stop_str_in_output`).
    stream_interval: stream a chunk every this many tokens (None: every step).
    json_schema, regex, ebnf, structural_tag: a grammar the output must follow (structured
                    output, compiled by xgrammar; at most one per request). json_schema is a
                    JSON Schema as JSON text, or "$$ANY$$" for any JSON value; regex a
                    regular expression the whole output matches; ebnf a GBNF grammar whose
                    start rule is `root`; structural_tag xgrammar's structural-tag JSON.

    The rest of SGLang 0.5.2's fields are accepted at their defaults only, so a client that
    always sends them works, and a feature pyserve lacks is refused, never ignored:
    `custom_params` (None), `spaces_between_special_tokens` (true: what the fast tokenizers
    do).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int | None = Field(default=128, ge=0)
    # (the worker keeps temperatures as float32: a larger one would become inf, uniform sampling)
    temperature: float = Field(default=1.0, ge=0.0, le=FLOAT32_MAX, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_new_tokens: int = Field(default=0, ge=0, le=INT64_MAX)  # (the worker's rows are int64)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # torch.Generator.manual_seed's range
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    no_stop_trim: bool = False
    stream_interval: int | None = Field(default=None, ge=1)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # SGLang fields accepted at their default only (see the class docstring)
    custom_params: dict[str, Any] | None = None
    spaces_between_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingParams:
        given = [name for name in GRAMMAR_KINDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of json_schema, regex, ebnf and structural_tag (got {', '.join(given)})"
            )
        return self

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar (kind: one of GRAMMAR_KINDS), or None."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @field_validator("custom_params")
    @classmethod
    def _no_custom_params(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            raise ValueError("custom logit processors are not supported; leave it null")
        return v

    @field_validator("spaces_between_special_tokens")
    @classmethod
    def _spaces(cls, v: bool) -> bool:
        if not v:
            raise ValueError("only true is supported (the fast tokenizers' decoding)")
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError("top_k must be -1 or 0 (all tokens) or >= 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if math.isnan(bias) or bias == math.inf:  # -inf bans a token; +inf would overflow
                raise ValueError("logit_bias values must be numbers below infinity (-inf bans a token)")
        return v

    @property
    def logit_bias_items(self) -> list[tuple[int, float]]:
        return [(int(k), float(b)) for k, b in (self.logit_bias or {}).items()]

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def stop_strs(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
