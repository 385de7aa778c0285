"""The device-side description of one model step (ForwardBatch) and its mode.

A ForwardBatch is built on the loop thread from the arrays the Rust core returns
(`pyserve._rs.KVCache.prepare_extend` / `prepare_decode`) and consumed on the worker thread by
`ModelRunner.forward`. It holds only tensors and plain numbers, never request objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.Enum):
    """EXTEND computes new tokens on top of a (possibly empty) cached prefix; DECODE computes
    exactly one new token per request."""

    EXTEND = enum.auto()
    DECODE = enum.auto()


@dataclass
class SamplingBatchInfo:
    """Per-request sampling parameters of one batch, as tensors on the model device.

    temperatures: [batch] float32; 0 means greedy.
    top_ps:       [batch] float32 in (0, 1].
    top_ks:       [batch] int64; a value >= vocab_size means "all tokens".
    generators:   one `torch.Generator` or None per request (seeded requests).
    min_ps:       [batch] float32 in [0, 1] or None (all 0).
    The optional logit adjustments below are None when no request of the batch uses them:
    frequency_penalties, presence_penalties: [batch] float32 (OpenAI semantics, over the
                  tokens generated so far, counted from output_token_rows/output_token_ids).
    output_token_rows, output_token_ids: [N] int64: row and id of every output token so far of
                  the requests with a frequency or presence penalty (one entry per occurrence).
    repetition_penalties: [batch] float32 (1 = none; CTRL, Keskar et al. 2019: over prompt and
                  output tokens, listed once per distinct token in seen_token_rows/_ids).
    seen_token_rows, seen_token_ids: [M] int64 for the repetition penalty.
    logit_bias_rows, logit_bias_ids: [K] int64; logit_bias_values: [K] float32.
    banned_rows, banned_ids: [J] int64: tokens masked to -inf (stop tokens of requests below
                  min_new_tokens).
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    generators: list = field(default_factory=list)
    min_ps: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    output_token_rows: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    seen_token_rows: torch.Tensor | None = None
    seen_token_ids: torch.Tensor | None = None
    logit_bias_rows: torch.Tensor | None = None
    logit_bias_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None
    banned_ids: torch.Tensor | None = None

    @property
    def is_all_greedy(self) -> bool:
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


@dataclass
class StepOutput:
    """What the worker hands back for one step.

    next_token_ids: [B] int. output_logprobs: [B] TokenLogprobs of the sampled token (one
    entry) or None per request. input_logprobs: [B] TokenLogprobs of the prompt tokens asked
    for, or None. failed_rows: rows whose own sampling parameters left no token to draw
    (their ids are meaningless; those requests fail, the others go on).
    """

    next_token_ids: list[int]
    output_logprobs: list[TokenLogprobs | None] | None = None
    input_logprobs: list[TokenLogprobs | None] | None = None
    failed_rows: list[int] = field(default_factory=list)


@dataclass
class ForwardBatch:
    """All inputs of one forward pass.

    Shapes (B = batch_size, T = num_tokens; T == B in DECODE):
      input_ids:     [T] int64   token ids to compute
      positions:     [T] int64   absolute position of each token in its sequence
      out_cache_loc: [T] int64   KV pool slot that receives each token's K and V
      seq_lens:      [B] int64   tokens per request after this step (prefix + new)
      extend_prefix_lens / extend_seq_lens: [B] int64 (EXTEND only) cached and new tokens
      kv_indptr:     [B + 1] int64  CSR offsets into kv_indices
      kv_indices:    [sum(seq_lens)] int32 (as the Rust core builds it; int64 works too)
                     KV slots of every token of request i, in order, at
                     kv_indices[kv_indptr[i]:kv_indptr[i + 1]] (new tokens included)
    All tensors are on the model device.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    extend_prefix_lens: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    sampling_info: SamplingBatchInfo | None = None
    logprob_info: LogprobBatchInfo | None = None
    # Set by the logits processor when logprob_info asks for prompt logprobs: [N, vocab]
    # float32 logits of the rows in input_logits_rows (token rows of the batch), worker only.
    input_logits_rows: torch.Tensor | None = None
    input_logits: torch.Tensor | None = None
