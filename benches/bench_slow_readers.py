"""Clients that stop reading their streams: what they cost the server and the other clients.

One `pyserve serve` process (stories260k by default). Three phases per round, the same
reading load each time:
  * alone: `--clients` streaming /generate requests that read every chunk; the median
    inter-token latency (ITL: the gap between consecutive chunks, one token each) and the
    server's resident memory (VmRSS) are recorded;
  * readers: `--slow` raw connections send a streamed /generate request with
    `return_logprob` and `top_logprobs_num` 20 and read everything; after `--settle-s` the
    same reading load runs beside them (what those requests' own decoding costs the others);
  * slow: the same `--slow` connections never read a byte (a small receive buffer, so their
    sockets fill at once).
The server's peak RSS over a phase is sampled every 50 ms.
Printed: the medians and the ratios of slow to alone (what clients that do not read cost the
others; goal at most 1.5x) and of slow to readers, the RSS growth of both phases (goal: under
100 MB), and how many extra requests the server still runs (and of those, how many are paused
for a client that is behind) at the reading load's start and end.

Checked: every reading request (greedy) gets its `--max-new-tokens` tokens and the same text in
every phase and round (clients beside it, reading or not, must not change its output);
otherwise the script exits with status 1 after its figures.

Usage: python benches/bench_slow_readers.py [--model-path PATH] [--clients 8] [--slow 30]
                                            [--max-new-tokens 400] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import aiohttp
import httpx
from serve_process import start_server

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("PYSERVE_SHARED", REPO.parent / "shared"))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def one_stream(
    session: aiohttp.ClientSession, url: str, prompt: str, max_new: int
) -> tuple[list[float], str, int]:
    """A reading client: (the gaps (s) between its chunks after the first, its text, its
    output tokens)."""
    sampling = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}
    body = {"text": prompt, "stream": True, "sampling_params": sampling}
    stamps: list[float] = []
    last: dict = {"text": "", "meta_info": {"completion_tokens": 0}}
    async with session.post(url + "/generate", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"/generate answered {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
                last = json.loads(line[len(b"data: ") :])
    return [b - a for a, b in zip(stamps, stamps[1:])], last["text"], last["meta_info"]["completion_tokens"]


async def reading_load(url: str, clients: int, max_new: int) -> tuple[list[float], list[tuple[str, int]]]:
    """(every client's chunk gaps (s), each client's (text, output tokens))."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        results = await asyncio.gather(
            *(one_stream(session, url, f"Once upon a time {i}", max_new) for i in range(clients))
        )
    return [g for gaps, _, _ in results for g in gaps], [(text, n) for _, text, n in results]


def slow_reader(port: int, max_new: int) -> socket.socket:
    """A connection that asks for a long streamed request with 20 top logprobs per token and
    never reads (its receive buffer as small as the kernel allows)."""
    body = json.dumps(
        {
            "text": "The little dog",
            "stream": True,
            "return_logprob": True,
            "top_logprobs_num": 20,
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


def drain_socket(sock: socket.socket) -> None:
    """Read and drop everything (the twin of a slow reader: the same request, read at once)."""
    try:
        while sock.recv(1 << 16):
            pass
    except OSError:  # closed by the phase's end
        pass


def run_phase(url: str, args: argparse.Namespace, pid: int, slow: int, read: bool) -> dict:
    socks = [slow_reader(args.port, args.slow_max_new_tokens) for _ in range(slow)]
    if read:
        for sock in socks:
            threading.Thread(target=drain_socket, args=(sock,), daemon=True).start()
    peak = [rss_mb(pid)]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(rss_mb(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if slow:
        time.sleep(args.settle_s)
    info = httpx.get(url + "/get_server_info").json()
    running_before, paused_before = info["num_running_reqs"], info["num_paused_reqs"]
    gaps, outputs = asyncio.run(reading_load(url, args.clients, args.max_new_tokens))
    info = httpx.get(url + "/get_server_info").json()
    stop.set()
    sampler.join()
    for s in socks:
        s.close()
    return {
        "median_itl_ms": 1e3 * statistics.median(gaps),
        "peak_rss_mb": max(peak),
        "slow_running_at_start": running_before,
        "slow_running_at_end": info["num_running_reqs"],
        "paused_at_start": paused_before,
        "paused_at_end": info["num_paused_reqs"],
        "outputs": outputs,
    }


def wait_idle(url: str) -> None:
    deadline = time.monotonic() + 120
    while httpx.get(url + "/get_server_info").json()["num_running_reqs"]:
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=str(SHARED / "models" / "stories260k"))
    p.add_argument("--port", type=int, default=30123)
    p.add_argument("--clients", type=int, default=8, help="reading clients (default: %(default)s)")
    p.add_argument("--slow", type=int, default=30, help="clients that never read (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="per reading request (default: %(default)s)")
    p.add_argument("--slow-max-new-tokens", type=int, default=400, help="per slow request (default: %(default)s)")
    p.add_argument("--settle-s", type=float, default=3.0, help="slow readers run alone first (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="baseline / slow phases, alternated (default: %(default)s)")
    p.add_argument("--server-args", default="", help="extra `pyserve serve` flags")
    args = p.parse_args()
    server = start_server(["--model-path", args.model_path, *args.server_args.split()], args.port)
    url = f"http://127.0.0.1:{args.port}"
    try:
        asyncio.run(reading_load(url, args.clients, 8))  # warm up
        phases = {"alone": (0, True), "readers": (args.slow, True), "slow": (args.slow, False)}
        rows = []
        for _ in range(args.rounds):
            for name, (extra, read) in phases.items():
                wait_idle(url)
                base_rss = rss_mb(server.pid)
                row = run_phase(url, args, server.pid, extra, read) | {"phase": name, "rss_before_mb": base_rss}
                rows.append(row)
                print(
                    f"{name:>7}: median ITL {row['median_itl_ms']:7.2f} ms  RSS {base_rss:7.1f} -> peak "
                    f"{row['peak_rss_mb']:7.1f} MB  extra requests running (paused): "
                    f"{row['slow_running_at_start']} ({row['paused_at_start']}) at start, "
                    f"{row['slow_running_at_end']} ({row['paused_at_end']}) at end",
                    flush=True,
                )
        itl = {name: statistics.median(r["median_itl_ms"] for r in rows if r["phase"] == name) for name in phases}
        growth = {
            name: max(r["peak_rss_mb"] - r["rss_before_mb"] for r in rows if r["phase"] == name)
            for name in ("readers", "slow")
        }
        print(
            f"\nmedian ITL: {itl['alone']:.2f} ms alone, {itl['readers']:.2f} ms beside {args.slow} clients that "
            f"read, {itl['slow']:.2f} ms beside {args.slow} that do not: {itl['slow'] / itl['alone']:.2f}x the "
            f"run alone (goal: at most 1.5x), {itl['slow'] / itl['readers']:.2f}x the readers' run"
        )
        print(
            f"RSS growth (at most, over the phase's start): {growth['slow']:.1f} MB with slow readers, "
            f"{growth['readers']:.1f} MB with the same requests read"
        )
    finally:
        server.terminate()
        server.wait(60)
    problems = [
        f"{r['phase']} phase: output tokens {[n for _, n in r['outputs']]}"
        for r in rows
        if any(n != args.max_new_tokens for _, n in r["outputs"])
    ]
    problems += [
        f"{r['phase']} phase: texts differ from the first phase's" for r in rows if r["outputs"] != rows[0]["outputs"]
    ]
    if problems:
        print("OUTPUTS DIFFER:", *problems, sep="\n  ")
        return 1
    print(
        f"outputs checked: {args.clients} greedy streams of {args.max_new_tokens} tokens, the same texts in every phase"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
