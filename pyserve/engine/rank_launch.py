"""Starting the tensor-parallel ranks of one node and watching them.

Rank 0 (the serving process) serves the rendezvous store and starts ranks 1..k-1 of its node
as `python -m pyserve.engine.rank_main` processes; on a node of `--node-rank` r > 0,
`pyserve serve` starts that node's ranks only. Each rank writes `connected/<rank>` into the
store before it builds its process groups, so a rank that fails before that (a bad flag, an
import error) is reported at once instead of after the groups' connect timeout. A thread per
process waits for its end; an end the launcher did not ask for is reported, once, through
`on_death`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pyserve.config import ServerArgs

if TYPE_CHECKING:
    from pyserve.distributed.group import TensorParallelGroup

logger = logging.getLogger(__name__)

# how long a rank may take from its start to its first word in the store (its imports)
CONNECT_WAIT_S = 300.0
# how long `stop` waits for the ranks to leave on their own before killing them
STOP_WAIT_S = 5.0


def split_addr(addr: str | None) -> tuple[str, int]:
    """--dist-init-addr "host:port" -> (host, port); None: this machine, a free port (0)."""
    if addr is None:
        return "127.0.0.1", 0
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be host:port, got {addr!r}")
    return host, int(port)


def node_ranks(args: ServerArgs) -> range:
    """The ranks this node runs: tp_size / nnodes consecutive ranks from node_rank's first."""
    per_node = args.tp_size // args.nnodes
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def rank_device(args: ServerArgs, rank: int) -> str:
    """The device of `rank` on its node: on CUDA one GPU per rank, numbered on each node from 0
    (rank 0 has cuda:0), so a node needs tp_size / nnodes visible GPUs; "cpu" otherwise."""
    device = args.resolved_device
    if not device.startswith("cuda"):
        return device
    return f"cuda:{rank - node_ranks(args).start}"


def threads_per_rank(args: ServerArgs) -> int:
    """CPU threads of each rank's torch work: this machine's cores shared by its ranks."""
    return max(1, (os.cpu_count() or 1) // len(node_ranks(args)))


def describe_exit(code: int) -> str:
    """A process's return code in words ("exit status 1", "signal SIGKILL")."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


class RankProcesses:
    """The ranks `ranks` of a `args.tp_size`-rank group, as child processes of this one, which
    reach the store at (host, port). on_death(rank, message) is called (from a watcher
    thread) when one ends unasked; the message is one line naming the rank, its pid and how
    it ended."""

    def __init__(
        self,
        args: ServerArgs,
        ranks: range,
        host: str,
        port: int,
        on_death: Callable[[int, str], None] | None = None,
    ) -> None:
        self.args = args
        self.on_death = on_death
        self.on_stop: Callable[[], None] | None = None  # called once the ranks are gone
        self._stopping = False
        self._reported = False
        self._lock = threading.Lock()
        env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank(args)))
        fields = {f: getattr(args, f) for f in args.__dataclass_fields__ if f != "api_key"}
        self.procs: dict[int, subprocess.Popen] = {}
        for rank in ranks:
            cmd = [
                sys.executable,
                "-m",
                "pyserve.engine.rank_main",
                "--rank",
                str(rank),
                "--store",
                f"{host}:{port}",
                "--server-args",
                json.dumps(fields),
                "--parent-pid",
                str(os.getpid()),
            ]
            # The rank reads its stdin until EOF (`rank_main.exit_with_parent`): the kernel
            # closes this end when this process ends, however it ends (SIGKILL too), so a rank
            # does not outlive the process that started it, even one killed while loading
            # (unless children forked from this process still hold the end, as they then hold
            # the group's sockets too).
            self.procs[rank] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE)
        for rank, proc in self.procs.items():
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"pyserve-rank{rank}-watch", daemon=True
            ).start()

    def wait_connected(self, store: object) -> None:
        """Wait until every rank has written `connected/<rank>` into `store`. Raises
        RuntimeError naming the rank when one ended first, or did not come in CONNECT_WAIT_S."""
        deadline = time.monotonic() + CONNECT_WAIT_S
        waiting = dict(self.procs)
        while waiting:
            for rank, proc in list(waiting.items()):
                if store.check([f"connected/{rank}"]):  # type: ignore[attr-defined]
                    del waiting[rank]
                elif proc.poll() is not None:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) ended before it connected "
                        f"({describe_exit(proc.returncode)}); its log is above"
                    )
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks {sorted(waiting)} did not connect in {CONNECT_WAIT_S:.0f} s")
            if waiting:
                time.sleep(0.05)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            if self._stopping or self._reported:
                return
            self._reported = True
        message = f"tensor-parallel rank {rank} (pid {proc.pid}) died ({describe_exit(code)})"
        if self.on_death is not None:
            self.on_death(rank, message)

    def expect_end(self) -> None:
        """From now on the ranks' ends are asked for (rank 0 is about to send the stop): none
        is reported as a death."""
        with self._lock:
            self._stopping = True

    def stop(self) -> None:
        """Let the ranks end (rank 0 sent them the stop, or they lost it), killing any still
        running after STOP_WAIT_S; no death is reported from here on."""
        self.expect_end()
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        if self.on_stop is not None:
            self.on_stop()
            self.on_stop = None


def start_first_rank(
    args: ServerArgs, device: str, on_death: Callable[[int, str], None]
) -> tuple[TensorParallelGroup, RankProcesses]:
    """Rank 0's start: serve the store, start the node's other ranks (`RankProcesses`), wait
    until they connect, and join the group. On CPU this process's torch work then runs on
    `threads_per_rank` threads, as each rank's does, until `RankProcesses.stop` gives the
    process its thread count back. Raises RuntimeError (a rank ended
    before it connected, or the store's port is taken) after stopping what it started."""
    import torch

    from pyserve.distributed.group import TensorParallelGroup, connect_store

    host, port = split_addr(args.dist_init_addr)
    store = connect_store(host, port, args.tp_size, is_master=True)
    ranks = node_ranks(args)
    procs = RankProcesses(args, range(ranks.start + 1, ranks.stop), host, store.port, on_death)
    try:
        procs.wait_connected(store)
        if torch.device(device).type == "cpu":
            before = torch.get_num_threads()
            torch.set_num_threads(threads_per_rank(args))
            procs.on_stop = lambda: torch.set_num_threads(before)
        return TensorParallelGroup(store, 0, args.tp_size, device, args.tp_size // args.nnodes), procs
    except BaseException:
        procs.stop()
        raise


def serve_node(args: ServerArgs) -> int:
    """`pyserve serve --node-rank r` for r > 0: run this node's ranks until they end (rank 0
    stops them, or dies). Returns 0 when every rank ended with status 0, else 1. SIGTERM /
    SIGINT end the ranks (node 0 then fails its requests and stops). A Hub id as --model-path
    is fetched into this machine's Hugging Face cache first; when it cannot be, one line on
    stderr and 2 are returned, as `pyserve serve` does on node 0."""
    from pyserve.config import setup_logging
    from pyserve.model_loader.default_model import ModelNotFoundError
    from pyserve.model_loader.hub import resolve_hub_paths

    setup_logging(args.log_level)
    try:
        args = resolve_hub_paths(args)
    except ModelNotFoundError as exc:
        print(f"pyserve: error: {exc}", file=sys.stderr)
        return 2
    host, port = split_addr(args.dist_init_addr)
    procs = RankProcesses(args, node_ranks(args), host, port, on_death=lambda rank, message: logger.error(message))

    def end_ranks(signum: int, frame: object) -> None:
        for proc in procs.procs.values():
            proc.terminate()

    signal.signal(signal.SIGTERM, end_ranks)
    signal.signal(signal.SIGINT, end_ranks)
    codes = [proc.wait() for proc in procs.procs.values()]
    return 0 if all(code == 0 for code in codes) else 1
