"""`pyserve bench serve` against a stand-in OpenAI-compatible server written here: fixed
replies on a known schedule (a first chunk after 300 ms, then chunks of 2, 1 and 2 tokens
100 ms apart), so the measured TTFT / ITL / TPOT / E2E can be checked against designed delays.
Prompts containing FAIL get a 500 and prompts containing CUT a stream without [DONE].
Tolerances are generous: the machine running the tests may be loaded."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from pyserve.bench.cli import main as bench_main
from tests.conftest import STORIES_PATH, free_port

TTFT_S = 0.3
GAP_S = 0.1
# "Once upon a time there was" is 6 stories260k tokens: 1 + 2 + 1 + 2
CHUNKS = ["Once", " upon a", " time", " there was"]
NUM_OUTPUT = 6
PROMPT_TOKENS = 11  # what the stand-in reports as usage


def _body(kind: str, text: str | None, usage: dict | None) -> str:
    if kind == "chat":
        choices = [] if text is None else [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    else:
        choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": None}]
    return f"data: {json.dumps({'choices': choices, 'usage': usage})}\n\n"


def make_app() -> Starlette:
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "standin-model", "object": "model"}]})

    async def complete(request: Request, kind: str):  # type: ignore[no-untyped-def]
        body = await request.json()
        prompt = body["prompt"] if kind == "text" else body["messages"][0]["content"]
        assert body["model"] == "standin-model" and body["stream"] is True
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "no"}}, status_code=500)
        include_usage = (body.get("stream_options") or {}).get("include_usage", False)

        async def events():  # type: ignore[no-untyped-def]
            if kind == "chat":
                yield _body(kind, "", None)  # role-only chunk: no token
            await asyncio.sleep(TTFT_S)
            for i, text in enumerate(CHUNKS):
                if i:
                    await asyncio.sleep(GAP_S)
                yield _body(kind, text, None)
                if "CUT" in prompt and i == 1:
                    return
            if include_usage:
                yield _body(
                    kind,
                    None,
                    {
                        "prompt_tokens": PROMPT_TOKENS,
                        "completion_tokens": NUM_OUTPUT,
                        "total_tokens": PROMPT_TOKENS + NUM_OUTPUT,
                    },
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(request: Request):  # type: ignore[no-untyped-def]
        return await complete(request, "text")

    async def chat_completions(request: Request):  # type: ignore[no-untyped-def]
        return await complete(request, "chat")

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ]
    )


@pytest.fixture(scope="module")
def standin():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


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
    from tests.conftest import REPO

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
