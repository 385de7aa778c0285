"""A `pyserve serve` subprocess for the benchmarks that drive a real server."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx


def start_server(args: list[str], port: int, timeout_s: float = 300.0) -> subprocess.Popen:
    """`python -m pyserve serve --port PORT --log-level warning ARGS...`, returned once its
    /health answers 200. Raises RuntimeError when it exits or is not ready in time."""
    cmd = [sys.executable, "-m", "pyserve", "serve", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start: {' '.join(cmd)}")
        time.sleep(0.2)
