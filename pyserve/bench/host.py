"""`pyserve bench host`: the host path (HTTP, tokenizer, scheduler, Rust core, detokenizer, one
event loop) measured against a simulated device (DESIGN.md section 8).

The full server runs in this process on a `SimulatedRunner` (its steps only take time, with
the GIL released); the load comes from `pyserve bench serve` in a subprocess, as a real client
would (no GIL shared with the server). For each case it prints generated tokens/s, the device
busy fraction (simulated busy time / the client's timed duration) and the loop thread's CPU
time per generated token (the thread's own CPU clock, read from outside it), with the stream
writer thread's CPU per token beside it (it sends the SSE chunks with the GIL released; see
pyserve.server.socket_writer), and with `--output-file` appends one JSON line per case.
`--backend` picks the route the load uses (native /generate, OpenAI chat or completions);
several backends run as cases of the same run, against the same server.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pyserve.bench.backends import BACKENDS
from pyserve.bench.serve import BenchError

# What the host path must keep up with: an H200 decode step of a 0.5B model at 256 requests
# (~2 ms) and of an 8B model at 64 requests (~5 ms); prefill at ~1 us per token.
DEFAULT_CLIENTS = [1, 64, 256]
DEFAULT_DECODE_STEP_MS = [2.0, 5.0]


def add_host_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model-path", default=None, help="whose tokenizer serves (default: the default model, SmolLM2)")
    a(
        "--clients",
        type=int,
        nargs="+",
        default=DEFAULT_CLIENTS,
        help="concurrent clients per case (default: %(default)s)",
    )
    a(
        "--decode-step-ms",
        type=float,
        nargs="+",
        default=DEFAULT_DECODE_STEP_MS,
        help="simulated decode step time of the whole batch, per case (default: %(default)s)",
    )
    a(
        "--decode-us-per-req",
        type=float,
        default=0.0,
        help="extra decode time per running request (default: %(default)s)",
    )
    a("--extend-us-per-token", type=float, default=1.0, help="simulated prefill time per token (default: %(default)s)")
    a(
        "--backend",
        choices=BACKENDS,
        nargs="+",
        default=["pyserve"],
        help="the API the load uses, per case: pyserve (/generate), openai (/v1/completions), "
        "openai-chat (/v1/chat/completions) (default: %(default)s)",
    )
    a(
        "--stream",
        choices=["on", "off", "both"],
        default="both",
        help="streamed and/or whole responses (default: %(default)s)",
    )
    a("--input-len", type=int, default=256, help="prompt tokens per request (default: %(default)s)")
    a("--output-len", type=int, default=256, help="output tokens per request (default: %(default)s)")
    a("--requests-per-client", type=int, default=1, help="requests each client sends in a case (default: %(default)s)")
    a(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s sent at most (Poisson arrivals, as bench serve's flag); finite rates stagger "
        "the clients so they do not run in lockstep (default: %(default)s: all at once)",
    )
    a(
        "--overlap",
        choices=["on", "off", "both"],
        default="both",
        help="overlap scheduling on and/or off (--disable-overlap-schedule) (default: %(default)s)",
    )
    a(
        "--metrics",
        choices=["on", "off", "both"],
        default="on",
        help="the engine's /metrics recording on and/or off (--disable-metrics), to measure its cost on "
        "the loop (default: %(default)s)",
    )
    a(
        "--client-cpus",
        default=None,
        metavar="LIST",
        help="run the load generator on these CPUs (taskset's list, e.g. 12-15) and the server on the "
        "others, so the client does not take the server's cores (default: both on all)",
    )
    a(
        "--writer",
        choices=["socket", "asgi"],
        default="socket",
        help="what writes the streams: the socket writer thread, or the ASGI send (what any ASGI server "
        "other than uvicorn gets) (default: %(default)s)",
    )
    a("--output-file", default=None, help="append one JSON line per case")


def parse_cpu_list(text: str) -> set[int]:
    """CPU numbers of a taskset-style list ("0-3,8,10-11"). Raises BenchError on a malformed
    list or one naming CPUs this process may not run on."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise BenchError(f"--client-cpus {text!r}: expected a list like 12-15 or 2,3") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus < allowed:
        raise BenchError(
            f"--client-cpus {text!r}: must be a proper subset of the CPUs this process "
            f"may use ({min(allowed)}-{max(allowed)}, {len(allowed)} of them)"
        )
    return cpus


class HostServer:
    """The pyserve app on a SimulatedRunner, served by uvicorn on its own thread and loop."""

    def __init__(
        self,
        model_path: str | None,
        max_running_requests: int,
        context_len: int,
        max_total_tokens: int,
        socket_writes: bool = True,
    ) -> None:
        import socket

        import uvicorn

        from pyserve.config import ServerArgs
        from pyserve.model_executor.simulated_runner import SimulatedRunner
        from pyserve.model_loader.default_model import default_model_path
        from pyserve.model_loader.tokenizer import get_tokenizer
        from pyserve.server.app import create_app
        from pyserve.server.http1 import HTTP1Protocol
        from pyserve.server.stream_hub import StreamHub

        path = model_path or default_model_path()
        tok = get_tokenizer(path)
        eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        self.runner = SimulatedRunner(len(tok), eos, max_total_tokens, context_len)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = ServerArgs(
            model_path=path,
            port=self.port,
            max_running_requests=max_running_requests,
            max_prefill_tokens=max(8192, context_len),
            log_level="warning",
            stats_interval_s=3600.0,
        )
        self.app = create_app(args, model_runner=self.runner)
        self.app.context.stream_hub = StreamHub(socket_writes=socket_writes)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, loop="uvloop", http=HTTP1Protocol, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="pyserve-host-loop", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise BenchError("the in-process server did not start")
            time.sleep(0.05)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.loop_clock = time.pthread_getcpuclockid(self.thread.ident)  # type: ignore[arg-type]

    def loop_cpu_s(self) -> float:
        """CPU seconds the server's loop thread has used (its own clock, read from here)."""
        return time.clock_gettime(self.loop_clock)

    def writer_cpu_s(self) -> float:
        """CPU seconds the stream writer thread has used (0 before it started)."""
        from pyserve.server.socket_writer import THREAD_NAME

        for thread in threading.enumerate():
            if thread.name == THREAD_NAME and thread.ident is not None:
                try:
                    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
                except OSError:  # it just ended
                    return 0.0
        return 0.0

    def set_overlap(self, overlap: bool) -> None:
        """Overlap scheduling on or off from the next scheduler tick (between cases only)."""
        self.app.context.serving_engine().scheduler.overlap = overlap

    def set_metrics(self, on: bool) -> None:
        """The engine's request metrics recorded or not (between cases only)."""
        from pyserve.metrics import RequestMetrics

        self.app.context.serving_engine().scheduler.state.metrics = RequestMetrics() if on else None

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def run_case(
    server: HostServer,
    clients: int,
    stream: bool,
    decode_ms: float,
    overlap: bool,
    args: Any,
    backend: str = "pyserve",
    metrics_on: bool = True,
) -> dict[str, Any]:
    """One case: the runner's timing, the scheduler's overlap and the metrics recording set,
    the cache flushed, `bench serve` run against it."""
    runner = server.runner
    server.set_overlap(overlap)
    server.set_metrics(metrics_on)
    runner.decode_base_ms, runner.decode_us_per_req = decode_ms, args.decode_us_per_req
    runner.extend_us_per_token = args.extend_us_per_token
    httpx.post(server.base_url + "/flush_cache", timeout=30).raise_for_status()
    num = clients * args.requests_per_client
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serve.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "pyserve",
            "bench",
            "serve",
            "--backend",
            backend,
            "--port",
            str(server.port),
            "--num-prompts",
            str(num),
            "--max-concurrency",
            str(clients),
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--random-range-ratio",
            "1",
            "--warmup-requests",
            "0",
            "--disable-tqdm",
            "--request-rate",
            str(args.request_rate),
            "--output-file",
            str(out),
        ] + ([] if stream else ["--disable-stream"])
        if args.client_cpus:
            cmd = ["taskset", "-c", args.client_cpus] + cmd
        runner.reset_busy()
        cpu_before, writer_before = server.loop_cpu_s(), server.writer_cpu_s()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        cpu_s = server.loop_cpu_s() - cpu_before
        writer_s = server.writer_cpu_s() - writer_before
        busy_s = runner.busy_s()
        if proc.returncode != 0:
            raise BenchError(f"bench serve failed: {proc.stderr.strip()[-2000:]}")
        metrics = json.loads(out.read_text().splitlines()[-1])["metrics"]
    tokens = metrics["total_output_tokens"]
    return {
        "kind": "host",
        "backend": backend,
        "writer": getattr(args, "writer", "socket"),
        "clients": clients,
        "stream": stream,
        "decode_step_ms": decode_ms,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "requests": num,
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "output_tok_s": metrics["output_throughput"],
        "device_busy_fraction": busy_s / metrics["duration_s"] if metrics["duration_s"] else None,
        "loop_cpu_us_per_token": 1e6 * cpu_s / tokens if tokens else None,
        "writer_cpu_us_per_token": 1e6 * writer_s / tokens if tokens else None,
        "device_steps": runner.num_steps,
        "duration_s": metrics["duration_s"],
        "overlap": overlap,
        "metrics": metrics_on,
    }


def run_host(args: Any) -> list[dict[str, Any]]:
    """All cases of `pyserve bench host`; prints a table, returns the JSON-able rows."""
    streams = {"on": [True], "off": [False], "both": [True, False]}[args.stream]
    # (a chat template adds its own tokens around the prompt: room for them)
    context_len = args.input_len + args.output_len + (8 if args.backend == ["pyserve"] else 256)
    if args.client_cpus:
        if shutil.which("taskset") is None:
            raise BenchError("--client-cpus needs taskset (util-linux), which is not on PATH")
        # the server's threads (the loop, the worker, torch's) keep off the client's CPUs
        server_cpus = os.sched_getaffinity(0) - parse_cpu_list(args.client_cpus)
        os.sched_setaffinity(0, server_cpus)
        print(f"load generator on CPUs {args.client_cpus}, server on the other {len(server_cpus)}")
    most = max(args.clients)
    server = HostServer(
        args.model_path,
        most,
        context_len,
        max_total_tokens=most * context_len + 4096,
        socket_writes=args.writer == "socket",
    )
    rows = []
    overlaps = {"on": [True], "off": [False], "both": [True, False]}[args.overlap]
    metrics = {"on": [True], "off": [False], "both": [True, False]}[getattr(args, "metrics", "on")]
    header = (
        f"{'backend':>11} {'overlap':>7} {'metrics':>7} {'clients':>7} {'stream':>6} {'step ms':>7} {'out tok/s':>10} "
        f"{'busy':>6} {'loop us/tok':>11} {'writer us/tok':>13} {'done/fail':>9}"
    )
    print(header)
    print("-" * len(header))
    try:
        for decode_ms, stream, clients, overlap, backend, metrics_on in itertools.product(
            args.decode_step_ms, streams, args.clients, overlaps, args.backend, metrics
        ):
            row = run_case(server, clients, stream, decode_ms, overlap, args, backend, metrics_on)
            rows.append(row)
            busy = row["device_busy_fraction"]
            on_off = {True: "on", False: "off"}
            print(
                f"{backend:>11} {on_off[overlap]:>7} {on_off[metrics_on]:>7} {clients:>7} {on_off[stream]:>6} "
                f"{decode_ms:>7.1f} {row['output_tok_s']:>10.0f} {busy:>6.3f} "
                f"{row['loop_cpu_us_per_token']:>11.1f} {row['writer_cpu_us_per_token']:>13.1f} "
                f"{row['completed']:>4}/{row['failed']:<4}",
                flush=True,
            )
            if args.output_file:
                with open(args.output_file, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
    finally:
        server.stop()
    asyncio.set_event_loop(None)
    return rows
