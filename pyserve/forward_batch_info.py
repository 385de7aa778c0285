"""The step's data types, below layers/ and models/ so nothing imports upward (DESIGN.md
section 2): what the loop plans for a step (`StepPlan`, host data only), what the worker builds
from it for the model (`ForwardBatch`, `SamplingBatchInfo`, `LogprobBatchInfo`), what comes
back (`StepOutput`, `TokenLogprobs`), what the scheduler hands the detokenizer per step
(`TokenOut`), and how a request ended (`FinishReason`, `EndCause`).

Threads: a StepPlan is built on the loop thread and read on the worker thread (never mutated
after it is handed over); a ForwardBatch lives on the worker thread only; a StepOutput is built
on the worker thread and read on the loop thread once its step is done.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


class FinishKind(str, enum.Enum):
    """Why a request ended: a stop token or string, its length limit, or an abort."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class EndCause(str, enum.Enum):
    """Why a request was ended before a stop or its length limit (a FinishReason of kind
    ABORT). The engine turns a cause into the exception an `Engine` caller gets
    (`pyserve.engine.end_cause.end_error`); server/errors.py's `END_CAUSE_HTTP` into the
    HTTP status, error type and code a client gets."""

    CLIENT_GONE = "client_gone"  # its consumer left: nothing more is emitted (`forget`)
    ABORTED = "aborted"  # /abort_request, Engine.abort_request
    STOPPED = "stopped"  # the engine stopped with the request unfinished
    SHUTDOWN = "shutdown"  # a drain's deadline passed with the request unfinished
    BUMPED = "bumped"  # let go from a full queue for a more urgent request
    BAD_PARAMS = "bad_params"  # its own parameters left nothing to sample mid-way
    GRAMMAR_REFUSED = "grammar_refused"  # its grammar did not compile (or not in time)
    STEP_FAILED = "step_failed"  # a model step raised while it ran
    SERVER_FAILED = "server_failed"  # serving cannot go on (a tensor-parallel rank died)


# what a request ended by the server's shutdown (EndCause.SHUTDOWN, STOPPED) is told
SHUTTING_DOWN_MESSAGE = "server shutting down"
# what a request an operator ended (EndCause.ABORTED: /abort_request, Engine.abort_request) is told
ABORTED_MESSAGE = "aborted by /abort_request"


@dataclass(frozen=True)
class FinishReason:
    """How a request ended (SGLang's meta_info `finish_reason`, typed).

    kind: FinishKind. matched: the stop token id (int) or stop string (str) that ended it
    (STOP only). length: output tokens when a LENGTH limit ended it. cause: why it was
    ended (ABORT only). message: what the consumer is told (ABORT). param: the request
    field the end is about (BAD_PARAMS, GRAMMAR_REFUSED: e.g. "json_schema"), when known.
    """

    kind: FinishKind
    matched: int | str | None = None
    length: int | None = None
    cause: EndCause | None = None
    message: str | None = None
    param: str | None = None

    @classmethod
    def stop(cls, matched: int | str) -> FinishReason:
        return cls(FinishKind.STOP, matched=matched)

    @classmethod
    def length_limit(cls, length: int) -> FinishReason:
        return cls(FinishKind.LENGTH, length=length)

    @classmethod
    def abort(cls, cause: EndCause, message: str, param: str | None = None) -> FinishReason:
        return cls(FinishKind.ABORT, cause=cause, message=message, param=param)

    @property
    def is_abort(self) -> bool:
        return self.kind is FinishKind.ABORT

    def to_json(self) -> dict[str, Any]:
        """SGLang's wire shape: {"type": "stop", "matched": ...}, {"type": "length",
        "length": n} or {"type": "abort", "message": ...}."""
        if self.kind is FinishKind.STOP:
            return {"type": "stop", "matched": self.matched}
        if self.kind is FinishKind.LENGTH:
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}


@dataclass(frozen=True)
class SamplingRow:
    """A request's sampling parameters, sent once when it is admitted to request row
    `req_pool_idx`; the worker keeps them on its device for as long as the row is live.

    params: the request's SamplingParams (read only). stop_token_ids: ids banned while fewer
    than params.min_new_tokens tokens were sampled (EOS included unless ignore_eos).
    seen_ids: [n] int32 the prompt (and output so far, when the request resumes after a
    retraction) for repetition_penalty, or None; output_ids: [m] int32 the output so far for
    frequency/presence penalties when resuming, or None. num_sampled: tokens the request
    sampled before this admission (min_new_tokens counts them). generator: the request's
    seeded torch.Generator on the model's device, or None (made by the loop once; only the
    worker draws from it). grammar: the request's compiled grammar (host data with
    `new_matcher()`: constrained/xgrammar_compiler.py, llguidance_compiler.py) or None. With a grammar,
    output_ids holds the output so far when the request resumes (its matcher replays it).
    """

    req_pool_idx: int
    params: Any  # pyserve.sampling_params.SamplingParams (not imported: it sits above)
    stop_token_ids: frozenset[int]
    seen_ids: np.ndarray | None = None
    output_ids: np.ndarray | None = None
    num_sampled: int = 0
    generator: torch.Generator | None = None
    grammar: Any = None


@dataclass
class StepPlan:
    """Everything the worker needs for one step, as host data (DESIGN.md section 1): O(batch)
    integers for a decode step, the new tokens' ids and slots for an extend step.

    Shapes (B requests, T new tokens; T == B in DECODE), numpy, C-contiguous, all int32 (the
    Rust core's `BatchArrays`, passed on unconverted; the worker refuses another dtype):
      req_pool_indices: [B] int32   request row of each request
      seq_lens:         [B] int32   tokens with KV after this step (prefix + new)
      positions:        [T] int32   position of each new token
      out_cache_loc:    [T] int32   KV slot receiving each new token's K/V
      input_ids:        [T - num_decode_rows] int32 (EXTEND) the new tokens; None in DECODE:
                        the worker reads each row's last sampled token from its token table
      prefix_lens, extend_lens: [B] int32 (EXTEND) cached and new tokens per request
      row_slots:        [sum(seq_lens)] int32 (EXTEND) the whole request row (cached prefix
                        and new slots) of each request, concatenated: written once into the
                        worker's req_to_token table; a DECODE step only adds out_cache_loc
    new_sampling_rows: requests whose sampling row starts this step (their admission).
    released_rows: rows whose requests left since the last plan: the worker drops their
        sampling state first (a row may be reused by new_sampling_rows of the same plan).
    num_decode_rows: (EXTEND) how many of the last rows are running requests decoding in this
        extend step (a mixed chunk): one new token each, read from the token table, not
        from input_ids.
    all_greedy: every request of the batch is greedy (the sampler needs no host check).
    logprob_info: what logprobs the batch wants, or None.
    step_id: a counter, for logs and tests.
    """

    forward_mode: ForwardMode
    req_pool_indices: np.ndarray
    seq_lens: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray
    input_ids: np.ndarray | None = None
    prefix_lens: np.ndarray | None = None
    extend_lens: np.ndarray | None = None
    row_slots: np.ndarray | None = None
    num_decode_rows: int = 0
    new_sampling_rows: list[SamplingRow] = field(default_factory=list)
    released_rows: list[int] = field(default_factory=list)
    all_greedy: bool = True
    logprob_info: LogprobBatchInfo | None = None
    step_id: int = 0

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


class ForwardMode(enum.Enum):
    """EXTEND computes new tokens on top of a (possibly empty) cached prefix; DECODE computes
    exactly one new token per request."""

    EXTEND = enum.auto()
    DECODE = enum.auto()


@dataclass
class SamplingBatchInfo:
    """Per-request sampling parameters of one batch, as tensors on the model device (row i is
    request i of the batch; the worker gathers them from its persistent sampling rows).

    temperatures: [batch] float32; 0 means greedy.
    top_ps:       [batch] float32 in (0, 1].
    top_ks:       [batch] int64; a value >= vocab_size means "all tokens".
    generators:   one `torch.Generator` or None per request (seeded requests).
    min_ps:       [batch] float32 in [0, 1] or None (all 0).
    all_greedy:   True/False when the caller knows (host data: no device sync), None to
                  compute it from temperatures.
    greedy_rows:  [batch] numpy bool, host: which rows are greedy (temperature 0), when the
                  caller knows (the worker's sampling rows do), so sampling needs no device
                  read; None to compute it from temperatures.
    The optional logit adjustments below are None when no request of the batch uses them:
    frequency_penalties, presence_penalties: [batch] float32 (OpenAI semantics, over the
                  tokens generated so far).
    output_token_counts: [batch, vocab] float32: how often each id was generated so far (rows
                  without frequency/presence penalties may hold anything: their penalty is 0).
    repetition_penalties: [batch] float32 (1 = none; CTRL, Keskar et al. 2019: over prompt and
                  output tokens).
    seen_token_mask: [batch, vocab] bool: ids seen in the prompt or output so far.
    logit_bias_rows, logit_bias_ids: [K] int64; logit_bias_values: [K] float32.
    banned_rows, banned_ids: [J] int64: tokens masked to -inf (stop tokens of requests below
                  min_new_tokens).
    grammar_bitmask: [G, ceil(vocab / 32)] int32: the allowed-token bitmasks of the batch's
                  rows under a grammar (structured output; xgrammar's layout: bit j of word w
                  allows id 32 * w + j); grammar_rows: [G] int32, the batch row each mask
                  row applies to.
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    generators: list = field(default_factory=list)
    min_ps: torch.Tensor | None = None
    all_greedy: bool | None = None
    greedy_rows: np.ndarray | None = None
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    output_token_counts: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    seen_token_mask: torch.Tensor | None = None
    logit_bias_rows: torch.Tensor | None = None
    logit_bias_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None
    banned_ids: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None

    @property
    def is_all_greedy(self) -> bool:
        if self.all_greedy is not None:
            return self.all_greedy
        return bool((self.temperatures == 0).all())


@dataclass
class LogprobBatchInfo:
    """What logprobs the requests of one batch want (host lists, B entries each).

    return_logprob:   [B] bool: logprob of the sampled token (and the lists below) wanted.
    top_logprobs_nums: [B] int: how many most likely tokens to report (0 = none).
    token_ids_logprob: [B] list of token ids whose logprobs to report, or None.
    input_logprob_starts: [B] int or None (EXTEND only): report the logprobs of this request's
        new tokens from this index in its extend range on (each token's logprob given the ones
        before it; the model must compute hidden states from the token before it on).
    """

    return_logprob: list[bool]
    top_logprobs_nums: list[int]
    token_ids_logprob: list[list[int] | None]
    input_logprob_starts: list[int | None]


@dataclass
class TokenLogprobs:
    """Logprobs of a run of tokens of one request (host values).

    token_logprobs: [n] float (None for a token with no preceding context: the first prompt
        token); top_logprobs: [n] (list of (logprob, id), most likely first) or None;
    token_ids_logprobs: [n] (list of (logprob, id) for the requested ids) or None.
    """

    token_logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]]] | None = None
    token_ids_logprobs: list[list[tuple[float, int]]] | None = None


@dataclass(slots=True)
class TokenOut:
    """New token ids of one request after one step (to the detokenizer), with their logprobs
    (output_logprobs: one entry per id of ids_delta) and, once, the prompt's (input_logprobs
    with the prompt ids they are about, input_logprob_ids) when the request asked."""

    rid: str
    ids_delta: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    output_logprobs: TokenLogprobs | None = None
    input_logprobs: TokenLogprobs | None = None
    input_logprob_ids: list[int] | None = None
    embedding: np.ndarray | None = None  # [hidden] float32: an embedding request's result


@dataclass
class StepOutput:
    """What the worker hands back for one step.

    next_token_ids: [B] int32 numpy array. output_logprobs: [B] TokenLogprobs of the sampled token (one
    entry) or None per request. input_logprobs: [B] TokenLogprobs of the prompt tokens asked
    for, or None. failed_rows: rows whose own sampling parameters left no token to draw
    (their ids are meaningless; those requests fail, the others go on). embeddings: [B, hidden]
    float32 numpy array of an embedding server's step (its next_token_ids are zeros), else None.
    """

    next_token_ids: np.ndarray
    output_logprobs: list[TokenLogprobs | None] | None = None
    input_logprobs: list[TokenLogprobs | None] | None = None
    failed_rows: list[int] = field(default_factory=list)
    embeddings: np.ndarray | None = None


def kv_indptr_of(seq_lens: torch.Tensor) -> torch.Tensor:
    """[B + 1] CSR offsets of B consecutive ranges of seq_lens [B] tokens (0 first), in
    seq_lens' dtype (int32 for a worker-built batch)."""
    indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=seq_lens.dtype, device=seq_lens.device)
    torch.cumsum(seq_lens, 0, dtype=seq_lens.dtype, out=indptr[1:])
    return indptr


@dataclass
class ForwardBatch:
    """All inputs of one forward pass, built on the worker thread from a StepPlan and the
    worker's DeviceState (or by hand in tests and benchmarks).

    Shapes (B = batch_size, T = num_tokens; T == B in DECODE); every integer tensor is int32
    in a worker-built batch (views of the plan's one packed int32 copy, or gathered from
    int32 tables); the backends and kernels accept int64 too (hand-built batches in tests):
      input_ids:     [T] int32   token ids to compute
      positions:     [T] int32   absolute position of each token in its sequence
      out_cache_loc: [T] int32   KV pool slot that receives each token's K and V
      seq_lens:      [B] int32   tokens per request after this step (prefix + new)
      extend_prefix_lens / extend_seq_lens: [B] int32 (EXTEND only) cached and new tokens
      kv_indptr:     [B + 1] int32  CSR offsets into kv_indices
      kv_indices:    [sum(seq_lens)] int32 KV slots of every token of
                     request i, in order, at kv_indices[kv_indptr[i]:kv_indptr[i + 1]] (new
                     tokens included). A worker-built DECODE batch leaves both None until an
                     attention backend asks (`ensure_kv_indices` gathers them from
                     req_to_token rows req_pool_indices).
      req_to_token:  [num_rows, row_width] int32 the worker's table of request rows, or None
      max_extend_len: host int (EXTEND) the longest extend_seq_lens entry, from the plan, so
                     kernels size their grids without reading the device
    All tensors are on the model device.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    kv_indptr: torch.Tensor | None
    kv_indices: torch.Tensor | None
    extend_prefix_lens: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    sampling_info: SamplingBatchInfo | None = None
    logprob_info: LogprobBatchInfo | None = None
    # Set by the logits processor when logprob_info asks for prompt logprobs: [N, vocab]
    # float32 logits of the rows in input_logits_rows (token rows of the batch), worker only.
    input_logits_rows: torch.Tensor | None = None
    input_logits: torch.Tensor | None = None
    # [B] int32: each request's row in the worker's tables (None for hand-built batches)
    req_pool_indices: torch.Tensor | None = None
    req_to_token: torch.Tensor | None = None
    max_extend_len: int | None = None

    def ensure_kv_indices(self) -> None:
        """Set kv_indptr / kv_indices from req_to_token when they were left None (O(B x
        longest seq_len) gather on the device; attention backends call this in
        init_forward_metadata). Raises ValueError when neither is available."""
        if self.kv_indices is not None and self.kv_indptr is not None:
            return
        if self.req_to_token is None or self.req_pool_indices is None:
            raise ValueError("a ForwardBatch needs kv_indices or its req_to_token rows")
        seq_lens = self.seq_lens
        max_len = int(seq_lens.max()) if self.batch_size else 0
        cols = torch.arange(max_len, device=seq_lens.device, dtype=seq_lens.dtype)
        self.kv_indptr = kv_indptr_of(seq_lens)
        self.kv_indices = self.req_to_token[self.req_pool_indices, :max_len][cols[None, :] < seq_lens[:, None]]
