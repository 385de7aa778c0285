"""`Runner`: what the engine and its worker need of a model runner, so the real `ModelRunner`
and the benchmarks' `SimulatedRunner` (or any other stand-in) serve behind one type.

The worker thread calls `forward`, `sample_next` and `add_logprobs`; the loop thread reads the
sizes and `info` once at start-up. What only some runners do is declared, not probed: `info`
says what the runner is (an embedding model, an encoder, asynchronous launches, graph memory)
and the hooks below have defaults, so a runner subclasses `Runner` and overrides what it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pyserve.forward_batch_info import ForwardBatch, StepOutput
from pyserve.layers.expert_load import ExpertLoad
from pyserve.layers.pooler import PoolingSpec

if TYPE_CHECKING:
    from pyserve.distributed.group import TensorParallelGroup


@dataclass(frozen=True)
class EmbeddingInfo:
    """An embedding model's output: `pooling` makes one vector of `hidden_size` floats per
    input; `matryoshka`: trained so that its first values are an embedding too (the config's
    `is_matryoshka` or `matryoshka_dimensions`), `matryoshka_dimensions` the sizes it lists
    (None: any up to hidden_size)."""

    pooling: PoolingSpec
    hidden_size: int
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner is, fixed once it is built (loop thread reads it at start-up).

    embedding: set when the runner serves pooled embeddings (`embed`) and never samples.
    is_encoder: bidirectional attention over each whole prompt, no KV kept (so no prefix to
    reuse and no prompt cut into chunks). async_launch: `forward` returns before the device
    has run the step (beyond CUDA's own streams): the worker waits through `step_done_waiter`.
    cuda_graph_bytes: device memory set aside for decode graphs (0 without them)."""

    embedding: EmbeddingInfo | None = None
    is_encoder: bool = False
    async_launch: bool = False
    cuda_graph_bytes: int = 0


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
    attention_backend_name: the --attention-backend in use; info: what else it is
    (RunnerInfo); tp: its rank of a tensor-parallel group (None: the whole model).

    Subclass it explicitly to inherit the hooks' defaults (`init_cuda_graphs`,
    `step_done_waiter`, `embed`)."""

    tp: TensorParallelGroup | None = None
    info: RunnerInfo = RunnerInfo()

    model_config: RunnerModelConfig
    device: str
    dtype: torch.dtype
    max_total_num_tokens: int
    kv_cache_bytes: int
    weight_bytes: int
    attention_backend_name: str

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (or what `sample_next` reads) of `batch`'s new tokens. Worker thread."""
        ...

    def sample_next(self, logits: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """([B] int64 next ids, [B] bool rows that had nothing to sample). Worker thread."""
        ...

    def add_logprobs(self, out: StepOutput, logits: torch.Tensor, batch: ForwardBatch, next_ids: torch.Tensor) -> None:
        """Fill `out`'s logprobs as `batch.logprob_info` asks. Worker thread."""
        ...

    def init_cuda_graphs(self, req_to_token: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Capture decode graphs over the worker's `req_to_token` table on its `stream`
        (worker thread, before the first step; called on CUDA only). Default: none."""
        return None

    def step_done_waiter(self) -> Callable[[], None]:
        """A function that returns once the step launched last has ended on the device.
        Worker thread; the worker asks only when `info.async_launch`. Default: a runner whose
        `forward` returns when the step has run, so there is nothing to wait for."""
        return _nothing_to_wait_for

    def expert_load(self) -> ExpertLoad | None:
        """The routing counts of a mixture-of-experts model (pyserve.layers.expert_load.ExpertLoad);
        None for a dense one (the default)."""
        return None

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """[B, hidden_size] float32 pooled embeddings of `batch`'s sequences. Worker thread;
        called only when `info.embedding` is set."""
        raise TypeError(f"{type(self).__name__} serves no embeddings (info.embedding is None)")


def _nothing_to_wait_for() -> None:
    return None
