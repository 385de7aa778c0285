"""Shared test fixtures: paths of the real small models and a real pyserve server process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter (numpy, small shapes). It must be
# set before any kernel module is imported: @triton.jit reads it when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PYSERVE_SHARED", REPO.parent / "shared"))
STORIES_PATH = SHARED / "models" / "stories260k"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m pyserve serve ...` in a subprocess, on a free port, logs to a file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyserve", "serve", "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def start_server(tmp_path_factory: pytest.TempPathFactory, name: str, args: list[str]) -> ServerProcess:
    server = ServerProcess(args, tmp_path_factory.mktemp(name) / "server.log")
    try:
        server.wait_ready()
    except Exception:
        server.stop()
        raise
    return server


CHAT_TEMPLATE = REPO / "tests" / "data" / "stories_chat_template.jinja"


def is_idle(info: dict) -> bool:
    """True when a /get_server_info (or Engine.get_server_info) dict shows nothing running,
    waiting (for admission or for its grammar) or holding KV, and no request, sampling or
    grammar row still live on the worker."""
    return (
        info["num_running_reqs"] == 0
        and info["num_waiting_reqs"] == 0
        and info["kv_protected_slots"] == 0
        and info["num_req_rows_used"] == 0
        and info["num_sampling_rows_live"] == 0
        and info["num_grammar_rows_live"] == 0
        and info["num_grammar_queue_reqs"] == 0
    )


def wait_idle(base_url: str, timeout_s: float = 30.0) -> dict:
    """/get_server_info once `is_idle` holds (raises AssertionError after timeout_s)."""
    import httpx

    return _poll_until_idle(lambda: httpx.get(base_url + "/get_server_info").json(), timeout_s, 0.05)


def wait_engine_idle(engine, timeout_s: float = 30.0) -> dict:
    """engine.get_server_info() once `is_idle` holds (raises AssertionError after timeout_s).

    A finished request's output reaches the caller before its rows are released on the worker
    thread (the release is a queued item the worker takes in turn), so a test that checks the
    counters right after `generate` returns must wait for them."""
    return _poll_until_idle(engine.get_server_info, timeout_s, 0.02)


def _poll_until_idle(get_info, timeout_s: float, period_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        info = get_info()
        if is_idle(info):
            return info
        assert time.monotonic() < deadline, info
        time.sleep(period_s)


def stories_chat_server(
    tmp_path_factory: pytest.TempPathFactory, stories_path: Path, name: str, pool: int, extra_args: list[str]
):
    """A stories260k server with the tests' chat template (yield from it in a fixture); at the
    end, once idle, every KV slot must be free or evictable (no leak)."""
    srv = start_server(
        tmp_path_factory,
        name,
        [
            "--model-path",
            str(stories_path),
            "--max-total-tokens",
            str(pool),
            "--chat-template",
            str(CHAT_TEMPLATE),
            *extra_args,
        ],
    )
    try:
        yield srv
        info = wait_idle(srv.base_url)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == pool
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def smollm2_hf_model():
    """transformers' SmolLM2 from the default model's GGUF, float32, loaded once per session
    (tens of seconds on the 2-core machine); tests only read it."""
    from tests.hf_reference import load_hf_gguf, smollm2_gguf

    return load_hf_gguf(str(smollm2_gguf()))


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    """transformers' tokenizer of the default model's GGUF, loaded once per session."""
    from transformers import AutoTokenizer

    from tests.hf_reference import smollm2_gguf

    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def stories_path() -> Path:
    assert (STORIES_PATH / "config.json").exists(), f"missing {STORIES_PATH}"
    return STORIES_PATH


@pytest.fixture(scope="session")
def stories_reference(stories_path: Path) -> list[dict]:
    return json.loads((stories_path / "greedy_reference.json").read_text())["cases"]


def make_stories_engine(
    stories_path: Path, max_total_tokens: int, max_running_requests: int = 8, page_size: int = 1, **kwargs
):
    """An in-process Engine on stories260k (shut it down after use); kwargs: ServerArgs."""
    from pyserve import Engine

    return Engine(
        model_path=str(stories_path),
        max_total_tokens=max_total_tokens,
        max_running_requests=max_running_requests,
        page_size=page_size,
        **kwargs,
    )


@pytest.fixture(scope="session")
def client_python() -> Path:
    """The interpreter of the client venv (`make client-venv`: SGLang's clients, lm-eval, the
    openai client, instructor, langchain); skips without it, fails when PYSERVE_REQUIRE_CLIENTS
    is set (make test sets it)."""
    venv = Path(os.environ.get("PYSERVE_CLIENT_VENV", Path.home() / ".cache" / "pyserve-client-venv"))
    if not any(venv.glob(".deps-*")):  # the Makefile's stamp, named by its requirements' hash
        message = f"no client venv at {venv}: run `make client-venv`"
        if os.environ.get("PYSERVE_REQUIRE_CLIENTS"):
            pytest.fail(message)
        pytest.skip(message)
    return venv / "bin" / "python"


def run_client(python: Path, args: list[str], cwd: Path, timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
    """Run `python args...` in `cwd` (also its HOME: clients cache datasets under ~/.cache),
    offline, without this process's PYTHONPATH; asserts it exits 0."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HOME": str(cwd),
    }
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{args[:3]} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc
