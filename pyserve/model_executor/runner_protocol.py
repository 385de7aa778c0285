"""`Runner`: what the engine and its worker need of a model runner, so the real `ModelRunner`
and the benchmarks' `SimulatedRunner` (or any other stand-in) serve behind one type.

The worker thread calls `forward`, `sample_next` and `add_logprobs`; the loop thread reads the
sizes once at start-up. A runner may also have `step_done_waiter()` (its launches are
asynchronous: the worker waits for a step's end through it) and `init_cuda_graphs()`; the
worker looks for those with getattr, so they are not part of the protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pyserve.forward_batch_info import ForwardBatch, StepOutput


class RunnerModelConfig(Protocol):
    """The model facts the engine reads (pyserve.model_loader.config.ModelConfig has more)."""

    @property
    def architecture(self) -> str: ...
    @property
    def context_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> set[int]: ...
    @property
    def dtype(self) -> torch.dtype: ...


class Runner(Protocol):
    """device: "cpu", "cuda", "cuda:1"...; dtype: of weights, activations and KV;
    max_total_num_tokens: KV slots; kv_cache_bytes, weight_bytes: device memory they take;
    attention_backend_name: the --attention-backend in use."""

    @property
    def model_config(self) -> RunnerModelConfig: ...
    @property
    def device(self) -> str: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def max_total_num_tokens(self) -> int: ...
    @property
    def kv_cache_bytes(self) -> int: ...
    @property
    def weight_bytes(self) -> int: ...
    @property
    def attention_backend_name(self) -> str: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (or what `sample_next` reads) of `batch`'s new tokens. Worker thread."""
        ...

    def sample_next(self, logits: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """([B] int64 next ids, [B] bool rows that had nothing to sample). Worker thread."""
        ...

    def add_logprobs(self, out: StepOutput, logits: torch.Tensor, batch: ForwardBatch, next_ids: torch.Tensor) -> None:
        """Fill `out`'s logprobs as `batch.logprob_info` asks. Worker thread."""
        ...
