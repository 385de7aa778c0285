"""Request and output shapes of the native API, shared by the HTTP routes and the Engine.

`GenerateReqInput` is what /generate accepts (SGLang's field names). `TokenizedGenerateReq` is
one request after tokenization, as the scheduler sees it. `GenerateOutput` is what a request's
consumer receives, once per streamed chunk or once at the end.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from pyserve.sampling_params import SamplingParams


class GenerateReqInput(BaseModel):
    """Body of POST /generate: exactly one of `text` and `input_ids`, single or a list."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None

    @model_validator(mode="after")
    def _check(self) -> "GenerateReqInput":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        n = self.batch_size
        if self.is_batch:
            if n == 0:
                raise ValueError("the batch of prompts is empty")
            if self.stream:
                raise ValueError("stream=true takes a single prompt, not a list")
            for name in ("sampling_params", "rid"):
                value = getattr(self, name)
                if isinstance(value, list) and len(value) != n:
                    raise ValueError(f"'{name}' has {len(value)} entries for {n} prompts")
            if isinstance(self.rid, list) and len(set(self.rid)) != n:
                raise ValueError("the rids of a batch must be unique")
        else:
            if isinstance(self.sampling_params, list) or isinstance(self.rid, list):
                raise ValueError("a list of sampling_params or rid needs a list of prompts")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids)  # type: ignore[arg-type]

    def split(self) -> list["SingleReq"]:
        """One SingleReq per prompt, each with its own rid and sampling params."""
        n = self.batch_size
        texts = self.text if isinstance(self.text, list) else [self.text] * n
        if self.input_ids is None:
            ids: list[list[int] | None] = [None] * n
        else:
            ids = self.input_ids if self.is_batch else [self.input_ids]  # type: ignore[list-item]
        sps = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params] * n
        if isinstance(self.rid, list):
            rids: list[str | None] = list(self.rid)
        elif self.rid is not None and n > 1:
            rids = [f"{self.rid}-{i}" for i in range(n)]
        else:
            rids = [self.rid] * n
        out = []
        for i in range(n):
            out.append(SingleReq(
                text=texts[i] if self.text is not None else None,
                input_ids=ids[i],
                sampling_params=(sps[i] or SamplingParams()).model_copy(),
                stream=self.stream,
                rid=rids[i] or uuid.uuid4().hex,
            ))
        return out


@dataclass
class SingleReq:
    """One prompt to generate from, before tokenization."""

    text: str | None
    input_ids: list[int] | None
    sampling_params: SamplingParams
    stream: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    add_special_tokens: bool = True


@dataclass
class TokenizedGenerateReq:
    """A request as the scheduler receives it."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]


@dataclass
class GenerateOutput:
    """One chunk of output for a request.

    text:  all text so far (stop strings removed); text_delta: what this chunk added.
    output_ids: all output token ids so far; ids_delta: the ones this chunk added.
    finish_reason: None while running, else {"type": "stop" | "length" | "abort", ...}
        ("matched": the stop string or stop token id; "message" for aborts).
    """

    rid: str
    text: str
    text_delta: str
    output_ids: list[int]
    ids_delta: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_native(self) -> dict[str, Any]:
        """SGLang's /generate response shape."""
        return {
            "text": self.text,
            "output_ids": list(self.output_ids),
            "meta_info": {
                "id": self.rid,
                "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": len(self.output_ids),
                "cached_tokens": self.cached_tokens,
            },
        }
