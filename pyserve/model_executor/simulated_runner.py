"""`SimulatedRunner`: a ModelRunner stand-in whose "device" only takes time, for measuring the
host path (DESIGN.md section 8). Benchmarks and tests only.

It behaves as a CUDA device does behind asynchronous launches: `forward` queues the step on
the device's timeline (it starts when the device finishes the step before, or now if idle) and
returns at once, and the worker then waits for the step's end with the GIL released
(`step_done_waiter`), as it would wait on a copy-done event. An EXTEND step takes
`extend_us_per_token` per token computed, a DECODE step `decode_base_ms` plus
`decode_us_per_req` per request. So the worker's own host work for the next step overlaps
the device's current one, as with a GPU, and the device idles only when no step was handed
to it in time. It returns seeded token ids that are never EOS (outputs run to
max_new_tokens) and records its busy time (the sum of its steps' times), so a benchmark can
report the device's busy fraction. Everything else of the server is real: HTTP, tokenizer,
scheduler, the Rust core, the detokenizer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pyserve.forward_batch_info import ForwardBatch, ForwardMode, StepOutput
from pyserve.model_executor.runner_protocol import Runner, RunnerInfo

# ids drawn ahead for sample_next (the largest batch it serves)
_STREAM_LEN = 1 << 20
# what `forward` returns in place of logits (sample_next does not read it)
_NO_LOGITS = torch.empty(0)


@dataclass
class SimulatedModelConfig:
    """The ModelConfig fields the engine reads."""

    context_len: int
    vocab_size: int
    eos_token_ids: set[int] = field(default_factory=set)
    architecture: str = "SimulatedForCausalLM"
    dtype: torch.dtype = torch.float32


class SimulatedRunner(Runner):
    """Serves a tokenizer's vocabulary on a simulated device.

    vocab_size, eos_token_ids: the tokenizer's (ids are drawn from the non-EOS ones).
    max_total_tokens: KV pool size in tokens; context_len: tokens per sequence.
    extend_us_per_token, decode_base_ms, decode_us_per_req: the device time model (set them
    between runs from any thread; a step reads them when it starts).
    seed: the token stream (the same sequence of steps gives the same ids).

    Worker thread: forward, sample_next, add_logprobs, step_output. Any thread: busy_s, reset_busy.
    """

    info = RunnerInfo(async_launch=True)
    device = "cpu"
    dtype = torch.float32
    attention_backend_name = "simulated"
    kv_cache_bytes = 0
    weight_bytes = 0
    packed_weight_bytes = 0

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: set[int],
        max_total_tokens: int,
        context_len: int,
        extend_us_per_token: float = 1.0,
        decode_base_ms: float = 2.0,
        decode_us_per_req: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.model_config = SimulatedModelConfig(context_len, vocab_size, set(eos_token_ids))
        self.max_total_num_tokens = max_total_tokens
        self.extend_us_per_token = extend_us_per_token
        self.decode_base_ms = decode_base_ms
        self.decode_us_per_req = decode_us_per_req
        ids = np.array([t for t in range(vocab_size) if t not in eos_token_ids], dtype=np.int64)
        # the id stream, drawn once: a step takes the next batch_size of it (wrapping around),
        # so its host cost is a slice, as a sampling kernel's launch is, not a numpy draw
        self._stream = ids[np.random.default_rng(seed).integers(0, len(ids), size=_STREAM_LEN)]
        self._cursor = 0
        self._no_failures = torch.zeros(_STREAM_LEN, dtype=torch.bool)
        self._lock = threading.Lock()
        self._busy_s = 0.0
        self._device_free_at = 0.0
        self.num_steps = 0

    def step_time_s(self, batch: ForwardBatch) -> float:
        """The simulated device time of `batch`, in seconds."""
        if batch.forward_mode is ForwardMode.EXTEND:
            return int(batch.input_ids.shape[0]) * self.extend_us_per_token * 1e-6
        return self.decode_base_ms * 1e-3 + batch.batch_size * self.decode_us_per_req * 1e-6

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Queue the step on the device timeline; returns at once (an asynchronous launch),
        with an empty tensor for logits."""
        duration = self.step_time_s(batch)
        with self._lock:
            start = max(time.perf_counter(), self._device_free_at)
            self._device_free_at = start + duration
            self._busy_s += duration
            self.num_steps += 1
        return _NO_LOGITS

    def step_done_waiter(self) -> Callable[[], None]:
        """A function that returns once the step launched last has ended on the device (it
        sleeps, releasing the GIL, as a wait on a CUDA event does)."""
        end = self._device_free_at

        def wait() -> None:
            while (left := end - time.perf_counter()) > 0:
                time.sleep(left)

        return wait

    def sample_next(self, logits: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[B] int64 seeded ids, never EOS (the next B of the seeded stream); the failed-row
        mask [B] bool (all False). A row under a grammar takes its stream id when the grammar
        allows it, else the lowest allowed id (EOS too, once the grammar ends). Raises
        ValueError for B > the stream's length."""
        size, start = batch.batch_size, self._cursor
        if size > _STREAM_LEN:
            raise ValueError(f"a batch of {size} exceeds the simulated id stream ({_STREAM_LEN})")
        end = start + size
        if end <= _STREAM_LEN:
            ids = self._stream[start:end]
        else:
            end -= _STREAM_LEN
            ids = np.concatenate((self._stream[start:], self._stream[:end]))
        self._cursor = end
        info = batch.sampling_info
        if info is not None and info.grammar_bitmask is not None and info.grammar_rows is not None:
            ids = ids.copy()
            masks = info.grammar_bitmask.numpy().view(np.uint32)
            for mask, row in zip(masks, info.grammar_rows.tolist()):
                ids[row] = _allowed_id(mask, int(ids[row]))
        return torch.from_numpy(ids), self._no_failures[:size]

    def add_logprobs(self, out: StepOutput, logits: torch.Tensor, batch: ForwardBatch, next_ids: torch.Tensor) -> None:
        """Logprobs are not simulated."""

    def step_output(self, logits: torch.Tensor, batch: ForwardBatch) -> StepOutput:
        ids, _ = self.sample_next(logits, batch)
        return StepOutput(next_token_ids=ids.to(torch.int32).numpy())

    def busy_s(self) -> float:
        """Seconds the device has been busy since the last reset_busy."""
        with self._lock:
            return self._busy_s

    def reset_busy(self) -> None:
        with self._lock:
            self._busy_s = 0.0
            self.num_steps = 0


def _allowed_id(mask: np.ndarray, token: int) -> int:
    """`token` if the bitmask `mask` ([ceil(vocab / 32)] uint32, bit j of word w allows id
    32 * w + j) allows it, else the lowest allowed id (0 when none is)."""
    if (int(mask[token >> 5]) >> (token & 31)) & 1:
        return token
    words = np.flatnonzero(mask)
    if words.shape[0] == 0:
        return 0
    word = int(mask[words[0]])
    return int(words[0]) * 32 + ((word & -word).bit_length() - 1)
