"""Tokens routed to each expert of each MoE layer: SGLang's expert distribution record (the
input of expert-parallel load balancing) and the Prometheus counter.

The counts are added on the model's device by torch ops that never read back to the host, so a
mixture's decode step can be captured in a CUDA graph; the worker publishes them to a host
array after each step, which the loop thread reads. A record (/start_expert_distribution_record
.. /stop_expert_distribution_record) is the difference of two snapshots of the totals, so the
step's work is the same whether a record runs or not (a captured graph cannot see the flag).
"""

from __future__ import annotations

import numpy as np
import torch


class ExpertLoad:
    """Routing counts of a model's sparse layers.

    layers: the decoder layer index of each sparse layer (L of them, in order); num_experts: E;
    device: the model's. `counts` [L, E] int64 on the device: added by the worker thread
    (`add`, or the native decoder layer into `total`'s rows on CPU, the same memory there).
    `total` [L, E] int64 numpy: the totals since the model was built, as last published
    (`publish`; on CPU always current); read by the loop thread, possibly a step behind.
    A token counts once per expert it is routed to, prompt tokens included; padding rows of a
    captured batch (KV slot 0, which no request owns: `set_valid`) do not count."""

    def __init__(self, layers: list[int], num_experts: int, device: torch.device | str = "cpu") -> None:
        self.layers = layers
        shape = (len(layers), num_experts)
        self.counts = torch.zeros(shape, dtype=torch.int64, device=device)
        if self.counts.device.type == "cpu":
            self._host = self.counts
        else:
            # on the host even inside `with torch.device("cuda")` (where models are built)
            self._host = torch.zeros(shape, dtype=torch.int64, device="cpu", pin_memory=torch.cuda.is_available())
        self.total: np.ndarray = self._host.numpy()
        # rows of the step being run that count ([T] bool on the device; None: all of them)
        self.valid: torch.Tensor | None = None
        self._start = np.zeros(shape, dtype=np.int64)
        self._stop: np.ndarray | None = self._start
        self.recording = False

    def set_valid(self, out_cache_loc: torch.Tensor) -> None:
        """Count only the step's tokens whose KV slot is not the padding slot 0. Worker thread,
        before the model's layers run."""
        self.valid = out_cache_loc != 0

    def add(self, row: int, ids: torch.Tensor) -> None:
        """Count one step's routing `ids` [T, k] (expert ids, on the device) of sparse layer
        `row`. Worker thread; no host synchronisation."""
        flat = ids.reshape(-1)
        if self.valid is not None and self.valid.shape[0] == ids.shape[0]:
            ones = self.valid[:, None].expand(ids.shape).reshape(-1).to(torch.int64)
        else:
            ones = torch.ones_like(flat, dtype=torch.int64)
        self.counts[row].index_add_(0, flat, ones)

    def publish(self) -> None:
        """Copy the device counts to the host array `total` (asynchronous on the worker's
        stream; on CPU nothing to do). Worker thread, after a step."""
        if self._host is not self.counts:
            self._host.copy_(self.counts, non_blocking=True)

    @property
    def recorded(self) -> np.ndarray:
        """[L, E] int64: the counts since `start`, up to `stop` (or now while recording);
        zeros before the first record."""
        end = self.total if self.recording or self._stop is None else self._stop
        return end - self._start

    def start(self) -> None:
        """Record from now on, from zero. Loop thread."""
        self._start = self.total.copy()
        self.recording = True

    def stop(self) -> None:
        """End the record; `recorded` keeps its counts (a stop without a record running
        changes nothing). Loop thread."""
        if not self.recording:
            return
        self._stop = self.total.copy()
        self.recording = False
