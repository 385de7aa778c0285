"""Request and output shapes of the native API, shared by the HTTP routes and the Engine.

`GenerateReqInput` is what /generate accepts (SGLang's field names). `TokenizedGenerateReq` is
one request after tokenization, as the scheduler sees it. `GenerateOutput` is what a request's
consumer receives, once per streamed chunk or once at the end.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, cast, overload

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pyserve.constrained.spec import ThinkBlock
from pyserve.forward_batch_info import FinishReason
from pyserve.sampling_params import SamplingParams


class _RidSource:
    """Random request ids (UUID4s, as 32 hex digits like `uuid4().hex`) from 4 KiB of
    `os.urandom` at a time: as unpredictable as uuid4 (a client cannot guess the next id and
    take it first), without a syscall per request on the loop (`os.urandom` releases the GIL,
    and the loop then waits to take it back from the worker or the stream writer)."""

    _BATCH = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf = b""
        self._at = 0
        # a forked child must not hand out the ids left in its parent's batch
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._buf, self._at = b"", 0

    def __call__(self) -> str:
        with self._lock:
            if self._at + 16 > len(self._buf):
                self._buf, self._at = os.urandom(self._BATCH), 0
            raw = self._buf[self._at : self._at + 16]
            self._at += 16
        return uuid.UUID(bytes=raw, version=4).hex


_rids = _RidSource()


def new_rid() -> str:
    """A fresh random request id: 32 lowercase hex digits (a UUID4). Any thread."""
    return _rids()


# SGLang request fields pyserve refuses unless left at their default, and the feature each names.
UNSUPPORTED_FIELDS = {
    "input_embeds": "input embeddings are",
    "image_data": "images are",
    "video_data": "videos are",
    "audio_data": "audio is",
    "modalities": "multimodal inputs are",
    "session_params": "sessions are",
    "lora_path": "LoRA adapters are",
    "lora_id": "LoRA adapters are",
    "custom_logit_processor": "custom logit processors are",
    "bootstrap_host": "prefill/decode disaggregation is",
    "bootstrap_port": "prefill/decode disaggregation is",
    "bootstrap_room": "prefill/decode disaggregation is",
    "bootstrap_pair_key": "prefill/decode disaggregation is",
    "return_hidden_states": "returning hidden states is",
    "background": "background requests are",
    "return_bytes": "returning bytes is",
    "return_entropy": "returning entropy is",
}


def is_unset(value: Any) -> bool:
    """True for a field's default: None, False, or an empty or all-default list."""
    if value is None or value is False:
        return True
    if isinstance(value, list):
        return all(is_unset(v) for v in value)
    return False


class GenerateReqInput(BaseModel):
    """Body of POST /generate: exactly one of `text` and `input_ids`, single or a list."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    # the served model (as routers such as sglang-router add it): its served name, "default"
    # or its path; another name gets a 404 (checked by the route, which knows the model)
    model: str | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    # logprobs (SGLang's names); a list gives one value per prompt
    return_logprob: bool | list[bool] | None = False
    logprob_start_len: int | list[int] | None = -1
    top_logprobs_num: Annotated[int, Field(ge=0)] | list[Annotated[int, Field(ge=0)]] | None = 0
    token_ids_logprob: list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]] | None = None
    return_text_in_logprobs: bool = False
    # metadata SGLang clients send; they do not change the output
    log_metrics: bool = True
    no_logs: bool = False  # sglang-router forwards it
    conversation_id: str | None = None
    label: str | None = None
    # The rest of SGLang 0.5.2's fields: accepted at their defaults (null, false, 0), so
    # clients that always send them work; any other value names a feature pyserve lacks and
    # is refused with a 400 naming the field.
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    modalities: Any = None
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    data_parallel_rank: int | None = None
    return_hidden_states: bool | list[bool] = False
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False  # sglang-router forwards it
    priority: int | None = None

    @field_validator(*UNSUPPORTED_FIELDS)
    @classmethod
    def _default_only(cls, v: Any, info: ValidationInfo) -> Any:
        if not is_unset(v):
            raise ValueError(
                f"{UNSUPPORTED_FIELDS[info.field_name]} not supported; leave it "  # type: ignore[index]
                "null (or false)"
            )
        return v

    @field_validator("priority", mode="before")
    @classmethod
    def _int_priority(cls, v: Any) -> Any:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError("priority must be an integer")
        return v

    @field_validator("data_parallel_rank")
    @classmethod
    def _one_rank(cls, v: int | None) -> int | None:
        if v not in (None, 0):
            raise ValueError("this server has one data-parallel rank, 0")
        return v

    @model_validator(mode="after")
    def _check(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        n = self.batch_size
        if self.is_batch:
            if n == 0:
                raise ValueError("the batch of prompts is empty")
            if self.stream:
                raise ValueError("stream=true takes a single prompt, not a list")
            for name in ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num"):
                value = getattr(self, name)
                if isinstance(value, list) and len(value) != n:
                    raise ValueError(f"'{name}' has {len(value)} entries for {n} prompts")
            if isinstance(self.rid, list) and len(set(self.rid)) != n:
                raise ValueError("the rids of a batch must be unique")
            ids_lists = self.token_ids_logprob
            if ids_lists and isinstance(ids_lists[0], list) and len(ids_lists) != n:
                raise ValueError(f"'token_ids_logprob' has {len(ids_lists)} lists for {n} prompts")
        else:
            if any(
                isinstance(getattr(self, name), list)
                for name in ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num")
            ) or (self.token_ids_logprob and isinstance(self.token_ids_logprob[0], list)):
                raise ValueError("a list of sampling_params, rid or logprob options needs a list of prompts")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        ids = self.input_ids
        return ids is not None and len(ids) > 0 and isinstance(ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text) if self.text is not None else len(self.input_ids or ())

    def split(self) -> list[SingleReq]:
        """One SingleReq per prompt, each with its own rid and sampling params."""
        n = self.batch_size
        texts = self.text if isinstance(self.text, list) else [self.text] * n
        if self.input_ids is None:
            ids: list[list[int] | None] = [None] * n
        else:
            # the validator checked the shape: a list of id lists in a batch, one id list else
            ids = (
                list(cast("list[list[int]]", self.input_ids)) if self.is_batch else [cast("list[int]", self.input_ids)]
            )
        sps = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params] * n
        parent = None
        if isinstance(self.rid, list):
            rids: list[str | None] = list(self.rid)
        elif self.rid is not None and self.is_batch:
            rids, parent = [f"{self.rid}-{i}" for i in range(n)], self.rid
        else:
            rids = [self.rid] * n

        def per_prompt(value: Any, i: int) -> Any:
            return value[i] if isinstance(value, list) else value

        token_ids = self.token_ids_logprob
        if token_ids and not isinstance(token_ids[0], list):
            token_ids = [token_ids] * n
        out = []
        for i in range(n):
            start = per_prompt(self.logprob_start_len, i)
            logprob = LogprobParams(
                return_logprob=bool(per_prompt(self.return_logprob, i)),
                logprob_start_len=None if start is None or start < 0 else start,
                top_logprobs_num=per_prompt(self.top_logprobs_num, i) or 0,
                token_ids_logprob=list(token_ids[i]) if token_ids else None,  # type: ignore[arg-type]
                return_text_in_logprobs=self.return_text_in_logprobs,
            )
            out.append(
                SingleReq(
                    text=texts[i] if self.text is not None else None,
                    input_ids=ids[i],
                    sampling_params=(sps[i] or SamplingParams()).model_copy(),
                    stream=self.stream,
                    rid=rids[i] or new_rid(),
                    logprob=logprob,
                    parent_rid=parent,
                    priority=self.priority,
                )
            )
        return out


@dataclass
class LogprobParams:
    """What logprobs one request wants (native API names; see README "Logprobs").

    return_logprob: report the logprob of every output token (and the options below).
    logprob_start_len: also report prompt tokens' logprobs from this prompt index on (None: no
        prompt logprobs). Prefix-cache reuse is limited so that those tokens are computed.
    top_logprobs_num: the k most likely tokens at each position (0: none).
    token_ids_logprob: logprobs of these ids at each position (None: none).
    return_text_in_logprobs: put each token's text in the entries (else null).
    """

    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False


@dataclass
class SingleReq:
    """One prompt to generate from, before tokenization."""

    text: str | None
    input_ids: list[int] | None
    sampling_params: SamplingParams
    stream: bool = False
    rid: str = field(default_factory=new_rid)
    add_special_tokens: bool = True
    logprob: LogprobParams = field(default_factory=LogprobParams)
    # the rid this one was derived from (a batch's rid gives `{rid}-{i}`): aborting the
    # parent aborts it too
    parent_rid: str | None = None
    priority: int | None = None  # with --enable-priority-scheduling (None: 0)
    # with a grammar: the thinking the model may write before the constrained answer (set by
    # the chat route when a reasoning parser is on); None: the grammar constrains all of it
    grammar_think: ThinkBlock | None = None
    # an embedding request (EngineCore.encode): max_new_tokens 0, its result the pooled
    # hidden states (GenerateOutput.embedding); only an embedding server takes it
    embed: bool = False


@dataclass
class TokenizedGenerateReq:
    """A request as the scheduler receives it."""

    rid: str
    input_ids: np.ndarray  # [n] int32, made once where the prompt was tokenized or parsed
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]
    logprob: LogprobParams = field(default_factory=LogprobParams)
    # quiet: only the final output is wanted and nothing needs text on the way (not streamed,
    # no stop strings, no logprobs): the scheduler hands its tokens on once, when it ends
    quiet: bool = False
    priority: int = 0  # higher runs first (lower with --schedule-low-priority-values-first)
    # SingleReq.grammar_think: part of the request's grammar (None: the grammar applies from
    # the start)
    grammar_think: ThinkBlock | None = None
    # time.perf_counter() when the tokenizer manager received it (None: when the scheduler
    # does): where its time to first token and end-to-end latency count from (/metrics)
    arrival_time: float | None = None


class IdsPrefix(Sequence[int]):
    """The first `length` items of an append-only list of token ids, without copying them: a
    request's cumulative output ids in each of its chunks (a copy per chunk would make a long
    stream O(tokens**2)). The owner only ever appends to `ids`, so the view never changes.
    Equal to any sequence with the same items; slicing gives a list. Loop thread only."""

    __slots__ = ("_ids", "_length")

    def __init__(self, ids: list[int], length: int | None = None) -> None:
        self._ids = ids
        self._length = len(ids) if length is None else length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self._ids[: self._length][index]
        if not -self._length <= index < self._length:
            raise IndexError("IdsPrefix index out of range")
        return self._ids[index % self._length]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._ids, self._length)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == self._length and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # a list's stand-in: not hashable either

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(slots=True)
class GenerateOutput:
    """One chunk of output for a request.

    text:  all text so far (stop strings removed); text_delta: what this chunk added.
    output_ids: all output token ids so far; ids_delta: the ones this chunk added.
    finish_reason: None while running, else a FinishReason (its kind, the matched stop string
        or token id, the message of an abort).
    logprobs: None unless the request asked (return_logprob); then all entries so far, in
        SGLang's meta_info shapes: output_token_logprobs [[logprob, id, text-or-None], ...],
        output_top_logprobs [[entry, ...] or None per token], output_token_ids_logprobs,
        input_token_logprobs, input_top_logprobs, input_token_ids_logprobs (input ones:
        None unless logprob_start_len was given). `num_logprobs_delta`: how many output
        entries this chunk added (streaming). `index`: which of a request's n > 1 samples.
        Logprobs are floats; -inf is sent as LOGPROB_FLOOR (see `json_safe_logprob`).
    embedding: an embedding request's result, [hidden] float32 numpy (its final output only).
    """

    rid: str
    text: str
    text_delta: str
    output_ids: Sequence[int]  # a list, or an IdsPrefix view of the detokenizer's list
    ids_delta: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: dict[str, Any] | None = None
    num_logprobs_delta: int = 0
    index: int | None = None  # the sample's index among a request's n > 1 samples
    embedding: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_native(self) -> dict[str, Any]:
        """SGLang's /generate response shape (with "index" for one of n > 1 samples)."""
        out: dict[str, Any] = {} if self.index is None else {"index": self.index}
        return out | {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.native_meta()}

    def to_native_embedding(self) -> dict[str, Any]:
        """SGLang's /encode response shape: {"embedding": [floats], "meta_info": {...}}."""
        assert self.embedding is not None  # an embedding request's final output
        return {"embedding": self.embedding.tolist(), "meta_info": self.native_meta()}

    def native_meta(self) -> dict[str, Any]:
        """The "meta_info" object of `to_native`."""
        return {
            "id": self.rid,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.to_json(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            **(self.logprobs or {}),
        }


# What -inf (and NaN) logprobs become in JSON: a finite, clearly impossible value (as OpenAI
# uses for masked tokens), since JSON has no infinity.
LOGPROB_FLOOR = -9999.0


def json_safe_logprob(value: float | None) -> float | None:
    """`value`, or LOGPROB_FLOOR when it is -inf or NaN (None stays None)."""
    if value is None:
        return None
    if value != value or value == float("-inf"):
        return LOGPROB_FLOOR
    return value
