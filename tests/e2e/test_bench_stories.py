"""`pyserve bench serve` end to end: a real pyserve server on stories260k (with a chat template
for the chat backend), 32 prompts at concurrency 8 for each backend; every request succeeds
and the counted output tokens equal what the server generated (its own counter)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.conftest import REPO, start_server

TEMPLATE = REPO / "tests" / "data" / "stories_chat_template.jinja"
NUM_PROMPTS, OUTPUT_LEN = 32, 8


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_path):
    srv = start_server(
        tmp_path_factory,
        "bench-stories",
        ["--model-path", str(stories_path), "--max-total-tokens", "4096", "--chat-template", str(TEMPLATE)],
    )
    yield srv
    srv.stop()


def generated_tokens(server) -> int:
    return httpx.get(server.base_url + "/get_server_info", timeout=10).json()["num_generated_tokens"]


@pytest.mark.parametrize(
    "backend, entry",
    [
        ("pyserve", ["-m", "pyserve", "bench"]),
        ("openai", ["-m", "pyserve", "bench"]),
        ("openai-chat", ["-m", "pyserve.bench"]),  # the module entry point
    ],
)
def test_bench_serve_each_backend(server, tmp_path, backend, entry) -> None:
    out = tmp_path / "out.jsonl"
    plot = tmp_path / "p.png"
    before = generated_tokens(server)
    proc = subprocess.run(
        [
            sys.executable,
            *entry,
            "serve",
            "--backend",
            backend,
            "--port",
            str(server.port),
            "--num-prompts",
            str(NUM_PROMPTS),
            "--max-concurrency",
            "8",
            "--random-input-len",
            "24",
            "--random-output-len",
            str(OUTPUT_LEN),
            "--random-range-ratio",
            "1",
            "--warmup-requests",
            "1",
            "--output-file",
            str(out),
            "--output-details",
            "--plot",
            str(plot),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    delta = generated_tokens(server) - before
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert result["model"] == "stories260k" and result["tokenizer"] == server_model_path(server)
    assert result["token_count_source"] == "usage"
    assert (m["completed"], m["failed"], m["errors"]) == (NUM_PROMPTS, 0, {})
    # the warm-up request generated OUTPUT_LEN tokens the figures leave out
    assert m["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN == delta - OUTPUT_LEN
    assert [r["output_len"] for r in result["requests"]] == [OUTPUT_LEN] * NUM_PROMPTS
    if backend == "pyserve":  # the native stream reports exact per-chunk token counts
        assert all(sum(r["chunk_num_tokens"]) == OUTPUT_LEN for r in result["requests"])
        assert m["num_itl_samples"] == NUM_PROMPTS * (OUTPUT_LEN - 1)
    assert m["ttft_ms"]["mean"] > 0 and m["e2e_ms"]["p99"] >= m["e2e_ms"]["median"]
    assert 0 < m["mean_concurrency"] <= 8 + 1e-9
    assert f"successful / failed requests     {NUM_PROMPTS} / 0" in proc.stdout
    assert "tokens counted by                server usage" in proc.stdout
    assert plot.read_bytes()[:4] == b"\x89PNG"


def server_model_path(server) -> str:
    return httpx.get(server.base_url + "/get_model_info", timeout=10).json()["tokenizer_path"]
