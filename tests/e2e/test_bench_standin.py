"""`pyserve bench serve` against a stand-in OpenAI-compatible server written here: fixed
replies on a known schedule (a first chunk after 300 ms, then chunks of 2, 1 and 2 tokens
100 ms apart), so the measured TTFT / ITL / TPOT / E2E can be checked against designed delays.
Prompts containing FAIL get a 500 and prompts containing CUT a stream without [DONE].
The stand-in runs in its own process (tests/e2e/standin_server.py); tolerances are generous
above, tight below: the machine running the tests may be loaded, never faster than designed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from pyserve.bench.cli import main as bench_main
from tests.conftest import REPO, STORIES_PATH, free_port
from tests.e2e.standin_server import NUM_OUTPUT, PROMPT_TOKENS


@pytest.fixture(scope="module")
def standin():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.standin_server", str(port)], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None and time.monotonic() < deadline
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def near(measured_ms: float, designed_ms: float, above: float, below: float = 10.0) -> bool:
    return designed_ms - below <= measured_ms < designed_ms + above


def run_bench(tmp_path, base_url: str, prompts: list[str], *extra: str) -> dict:
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"prompt": p, "output_len": NUM_OUTPUT}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    rc = bench_main(
        [
            "serve",
            "--base-url",
            base_url,
            "--tokenizer",
            str(STORIES_PATH),
            "--dataset-name",
            "jsonl",
            "--dataset-path",
            str(workload),
            "--num-prompts",
            str(len(prompts)),
            "--max-concurrency",
            "4",
            "--disable-tqdm",
            "--output-file",
            str(out),
            "--output-details",
            *extra,
        ]
    )
    assert rc == 0
    return json.loads(out.read_text().splitlines()[-1])


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_figures_match_designed_delays(tmp_path, standin, backend) -> None:
    result = run_bench(tmp_path, standin, ["Once upon a time"] * 8, "--backend", backend)
    m = result["metrics"]
    assert (result["model"], result["token_count_source"]) == ("standin-model", "usage")
    assert (m["completed"], m["failed"], m["errors"]) == (8, 0, {})
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (8 * PROMPT_TOKENS, 8 * NUM_OUTPUT)
    for r in result["requests"]:
        # per chunk: 1, 2, 1, 2 tokens; 5 ITL samples: 50, 50, 100, 50, 50 ms (designed)
        assert r["chunk_num_tokens"] == [1, 2, 1, 2] and len(r["itl_ms"]) == 5
        assert near(r["ttft_ms"], 300, above=250)
        itl = r["itl_ms"]
        assert itl[0] == itl[1] and itl[3] == itl[4]
        # a late chunk shortens the next gap: 10 ms of slack below, more above
        assert near(itl[0], 50, above=60) and near(itl[2], 100, above=120) and near(itl[3], 50, above=60)
        assert near(r["e2e_ms"], 600, above=400)
        assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / 5)
    assert m["num_itl_samples"] == 40
    assert near(m["itl_ms"]["median"], 50, above=60) and near(m["itl_ms"]["mean"], 60, above=60)
    assert near(m["tpot_ms"]["mean"], 60, above=80)
    # 8 requests, 4 at a time, ~600 ms each: ~1.2 s, ~4 in flight on average
    assert near(m["duration_s"] * 1000, 1200, above=1000)
    assert 2.5 < m["mean_concurrency"] <= 4.0 + 1e-9
    assert m["request_throughput"] == pytest.approx(8 / m["duration_s"])
    assert m["output_throughput"] == pytest.approx(48 / m["duration_s"])


def test_failures_are_counted_by_kind(tmp_path, standin) -> None:
    prompts = ["Once upon a time"] * 4 + ["FAIL now"] * 2 + ["CUT here"]
    result = run_bench(tmp_path, standin, prompts, "--backend", "openai", "--warmup-requests", "1")
    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (4, 3)
    assert m["errors"] == {"http_500": 2, "stream_error": 1}
    assert m["total_output_tokens"] == 4 * NUM_OUTPUT
    errors = [r["error"] for r in result["requests"]]
    assert errors == [None] * 4 + ["http_500"] * 2 + ["stream_error"]


def test_tokenizer_counting_without_usage(tmp_path, standin) -> None:
    # the stand-in omits usage when not asked: strip stream_options from the requests
    result = run_bench(
        tmp_path,
        standin,
        ["Once upon a time"] * 4,
        "--backend",
        "openai",
        "--extra-request-body",
        '{"stream_options": null}',
    )
    m = result["metrics"]
    assert result["token_count_source"] == "tokenizer"
    # "Once upon a time" is 4 tokens; the reply 6
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (16, 24)
    assert all(r["chunk_num_tokens"] == [1, 2, 1, 2] for r in result["requests"])
