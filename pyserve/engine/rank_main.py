"""A tensor-parallel rank other than 0: `python -m pyserve.engine.rank_main --rank R
--store HOST:PORT --server-args JSON` (started by `pyserve.engine.rank_launch`, never by hand).

It loads its shard of the model (`ModelRunner` with a `TensorParallelGroup`), then, on its main
thread, mirrors rank 0's worker step for step: each plan rank 0 broadcasts is applied to this
rank's own request tables (`DeviceState`) and run through its shard (the same collectives, in
the same order, as rank 0's forward); the ids rank 0 sampled arrive after each step and go into
the token table. It holds no scheduler, allocator or sampling state: every KV slot and request
row is rank 0's, which frees them for all ranks. Rank 0 sends only plans its own tables took,
so every rank runs every plan it gets. Exits 0 when rank 0 says stop; 1, with one line on
stderr, when rank 0 is gone (its sockets closed), when the process that started it is gone
(its stdin closed: even while loading), or when loading or a step fails here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading

import torch

from pyserve.config import ServerArgs, setup_logging
from pyserve.distributed.group import RankLostError, TensorParallelGroup, connect_store
from pyserve.distributed.messages import STOP_RANKS, RankStart
from pyserve.engine.rank_launch import rank_device, split_addr
from pyserve.forward_batch_info import StepPlan
from pyserve.model_executor.device_state import DeviceState
from pyserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger("pyserve.rank")


def build_runner(args: ServerArgs, tp: TensorParallelGroup) -> ModelRunner:
    """This rank's ModelRunner: rank 0's arguments (`EngineCore._load`), this rank's shard on
    this rank's device (`tp.device`)."""
    from pyserve.model_loader.default_model import default_model_path

    return ModelRunner.from_server_args(
        args, args.model_path or default_model_path(), tp.device, tp, load_progress=False
    )


def serve(runner: ModelRunner, tp: TensorParallelGroup) -> None:
    """Mirror rank 0's steps until it sends STOP_RANKS. Raises RankLostError when a
    collective fails (a rank died)."""
    device = runner.device
    cuda = device.startswith("cuda")
    stream = None
    if cuda:
        torch.cuda.set_device(torch.device(device))
        stream = torch.cuda.Stream()
    state: DeviceState | None = None
    with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        while True:
            msg = tp.recv_object()
            if msg == STOP_RANKS:
                return
            if isinstance(msg, RankStart):
                state = DeviceState(msg.num_rows, msg.row_width, msg.vocab_size, device)
                if stream is not None:  # tables made on the default stream: done before ours reads them
                    torch.cuda.synchronize()
                if stream is not None and msg.capture_graphs:
                    runner.init_cuda_graphs(state.req_to_token, stream)  # with rank 0's, size for size
                continue
            assert isinstance(msg, StepPlan) and state is not None, msg
            # rank 0 sends only plans its own tables took: one refused here is a fault of this
            # rank, which leaves the group out of step (main ends the process)
            batch = state.forward_batch(msg)
            runner.forward(batch)
            ids = tp.broadcast(torch.empty(msg.batch_size, dtype=torch.int32, device=device))
            assert batch.req_pool_indices is not None
            state.token_table[batch.req_pool_indices] = ids


def exit_with_parent(rank: int, parent: int) -> None:
    """End this process (status 1, one line on stderr) once the process that started it is
    gone: `RankProcesses` holds the write end of this process' stdin pipe and never writes,
    so EOF comes when that process has ended, however it ended (or, where it forked, when
    its children that inherited the end have too). A rank started by hand with another
    stdin ends at once: its stdin is not that pipe. Watched on a daemon
    thread; why not PR_SET_PDEATHSIG: it follows the thread that forked, and rank 0 starts
    its ranks from a thread that ends. `parent` (its pid) only names it in the line."""

    def watch() -> None:
        # os.read, not sys.stdin: a daemon thread blocked inside the buffered reader holds
        # its lock, which the interpreter's shutdown then cannot take
        chunk = b"?"
        with contextlib.suppress(OSError):
            while chunk:  # nothing is ever written: this returns only at EOF
                chunk = os.read(0, 4096)
        print(f"pyserve rank {rank}: stopping: the process that started it (pid {parent}) is gone", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=watch, name="pyserve-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pyserve.engine.rank_main")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True, help="host:port of rank 0's store")
    parser.add_argument("--server-args", required=True, help="rank 0's ServerArgs as JSON")
    # given, as this process may outlive it before reading its own parent's pid
    parser.add_argument("--parent-pid", type=int, default=None, help="pid of the process that started this one")
    ns = parser.parse_args(argv)
    # Ctrl-C reaches the terminal's whole process group: rank 0 drains, then stops the ranks
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(ns.rank, ns.parent_pid if ns.parent_pid is not None else os.getppid())
    fields = json.loads(ns.server_args)
    if fields.get("gc_threshold") is not None:
        fields["gc_threshold"] = tuple(fields["gc_threshold"])
    args = ServerArgs(**fields)
    setup_logging(args.log_level)
    host, port = split_addr(ns.store)
    try:
        store = connect_store(host, port, args.tp_size, is_master=False)
        store.set(f"connected/{ns.rank}", "1")
        device = rank_device(args, ns.rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))  # NCCL's communicator and Triton use it
        tp = TensorParallelGroup(store, ns.rank, args.tp_size, device, args.tp_size // args.nnodes)
        runner = build_runner(args, tp)
        serve(runner, tp)
    except RankLostError as exc:  # rank 0 is gone: nothing left to serve
        print(f"pyserve rank {ns.rank}: stopping: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a failed load or step: rank 0's watcher names this rank
        print(f"pyserve rank {ns.rank}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
