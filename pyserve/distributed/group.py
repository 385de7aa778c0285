"""`TensorParallelGroup`: the collectives of one tensor-parallel rank, over `torch.distributed`
process groups made directly on a TCPStore (no default group, so several engines may live in one
process, as the tests' do).

Tensors go over the device group (NCCL on CUDA, gloo on CPU); the step plans rank 0 sends to the
other ranks are pickled and broadcast over a gloo group on the CPU (objects never touch the
device). Every rank calls the same collectives in the same order: rank 0 from its worker
thread, the others from their main thread (`pyserve.engine.rank_main`).

A peer that dies closes its sockets: a gloo collective waiting for it fails within moments
(`RankLostError`), which is how a step learns of a dead rank; the launcher
(`pyserve.engine.rank_launch`) says which one. The gloo group's timeout is long, so an idle
server's ranks may wait for the next plan for days; NCCL's is NCCL_TIMEOUT.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

# how long a rank waits for a collective (an idle server's ranks wait this long for a plan)
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
# How long an NCCL collective may take. NCCL work exists only inside a step (or a graph
# capture), so this bounds one step, not an idle wait; a peer that died mid-step does not fail
# NCCL's wait as it fails gloo's, so past this NCCL's watchdog ends the process instead of the
# GPUs spinning for good.
NCCL_TIMEOUT = datetime.timedelta(minutes=5)
# how long the ranks wait for each other at start-up (the slowest rank's imports and load)
CONNECT_TIMEOUT = datetime.timedelta(minutes=10)


class RankLostError(RuntimeError):
    """A collective failed because a peer rank is gone (its sockets closed); the group can
    no longer run steps."""


class RankOutOfStepError(RankLostError):
    """Rank 0 failed a step after the other ranks began it (its own forward raised): their
    collectives no longer pair with rank 0's, so the group cannot run steps."""


def _wait(work: Any) -> None:
    """Wait for a collective; RankLostError (one line) when a peer is gone."""
    try:
        work.wait()
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RankLostError(f"a tensor-parallel peer is gone: {first}") from None


def connect_store(host: str, port: int, world_size: int, is_master: bool) -> dist.TCPStore:
    """The rendezvous store: rank 0 serves it on (host, port) (port 0: a free one, read back as
    `store.port`); the other ranks connect to it. Raises RuntimeError (DistStoreError) when a
    rank cannot connect within CONNECT_TIMEOUT or rank 0 cannot bind the port."""
    return dist.TCPStore(host, port, world_size, is_master, timeout=CONNECT_TIMEOUT, wait_for_workers=False)


class TensorParallelGroup:
    """Rank `rank` of `size` ranks on `device` ("cpu", "cuda", "cuda:1"), `local_size` of them
    (default: all) on this machine, sharing its memory.

    Shapes are the caller's: `all_reduce` sums [*] in place, `all_gather_last_dim` turns
    [N, d] on each rank into [N, size * d] (rank order), `broadcast` copies rank 0's [*] into
    every rank's tensor of the same shape and dtype. Each raises RankLostError when a peer
    died."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: str, local_size: int | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in 0..{size - 1}")
        self.rank = rank
        self.size = size
        self.local_size = size if local_size is None else local_size
        self.device = device
        # Typed Any: torch's stubs list neither the collectives of the concrete process groups
        # nor NCCL's (store, rank, size, timeout) constructor, which both exist at run time.
        gloo: Any = dist.ProcessGroupGloo
        nccl: Any = dist.ProcessGroupNCCL
        self._cpu: Any = gloo(dist.PrefixStore("gloo", store), rank, size, COLLECTIVE_TIMEOUT)
        if torch.device(device).type == "cuda":
            self._device: Any = nccl(dist.PrefixStore("nccl", store), rank, size, NCCL_TIMEOUT)
        else:
            self._device = self._cpu

    @property
    def is_first(self) -> bool:
        """Rank 0: the process with the scheduler, which samples and sends the plans."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        _wait(self._device.allreduce([tensor]))
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., d] on every rank -> [..., size * d]: the ranks' tensors side by side."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        _wait(self._device.allgather([parts], [tensor]))
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (in place); returns it."""
        _wait(self._device.broadcast(tensor, 0))
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (the KV pool size every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        _wait(self._cpu.allreduce([t], opts))
        return int(t.item())

    def send_object(self, obj: Any) -> None:
        """Rank 0: pickle `obj` and broadcast it (`recv_object` on the other ranks)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        _wait(self._cpu.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0))
        _wait(self._cpu.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0))

    def recv_object(self) -> Any:
        """Ranks 1..size-1: the next object rank 0 sent (`send_object`)."""
        length = torch.zeros(1, dtype=torch.int64)
        _wait(self._cpu.broadcast(length, 0))
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        _wait(self._cpu.broadcast(payload, 0))
        return pickle.loads(payload.numpy().tobytes())
