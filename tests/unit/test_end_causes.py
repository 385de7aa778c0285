"""Ending a request: `EngineCore.end(rids, cause, message)` answers every route as
server/errors.py's END_CAUSE_HTTP says, and `forget(rid)` (the client left) emits nothing
more: the scheduler hands the detokenizer no output of the request after it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from starlette.testclient import TestClient

from pyserve.config import ServerArgs
from pyserve.forward_batch_info import EndCause
from pyserve.model_executor.simulated_runner import SimulatedRunner
from pyserve.model_loader.tokenizer import get_tokenizer
from pyserve.server.app import create_app
from pyserve.server.errors import END_CAUSE_HTTP
from tests.conftest import CHAT_TEMPLATE, make_stories_engine, wait_engine_idle

POOL = 16384
LONG = 3000  # tokens: ~3 s of 1 ms steps, ended long before

ROUTES = {
    "/generate": {"text": "Once", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}},
    "/v1/completions": {"model": "m", "prompt": "Once", "max_tokens": LONG, "ignore_eos": True},
    "/v1/chat/completions": {
        "model": "m",
        "messages": [{"role": "user", "content": "Once"}],
        "max_tokens": LONG,
        "ignore_eos": True,
    },
    "/v1/responses": {"model": "m", "input": "Once", "max_output_tokens": LONG},
}


@pytest.fixture(scope="module")
def served(stories_path):
    tok = get_tokenizer(str(stories_path))
    runner = SimulatedRunner(len(tok), {tok.eos_token_id}, POOL, 4096, decode_base_ms=1.0)
    args = ServerArgs(
        model_path=str(stories_path),
        max_total_tokens=POOL,
        chat_template=str(CHAT_TEMPLATE),
        served_model_name="m",
        log_level="warning",
        stats_interval_s=3600.0,
    )
    app = create_app(args, model_runner=runner)
    with TestClient(app) as client:
        yield client, app


def ended_with(served, path: str, cause: EndCause) -> tuple[int, dict]:
    """Status and body of a whole (unstreamed) request on `path` ended with `cause` while
    it runs."""
    client, app = served
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(r=client.post(path, json=ROUTES[path])))
    thread.start()
    engine = app.context.engine
    deadline = time.monotonic() + 30
    while client.get("/get_server_info").json()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ended = client.portal.call(lambda: engine.end(engine.rids_of(every=True), cause, f"ended: {cause.value}"))
    thread.join(timeout=60)
    assert ended == 1
    return result["r"].status_code, result["r"].json()


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("cause", [c for c in EndCause if c is not EndCause.CLIENT_GONE])
def test_each_cause_answers_each_route_as_the_table_says(served, path, cause) -> None:
    status, body = ended_with(served, path, cause)
    http = END_CAUSE_HTTP[cause]
    if http is None:  # no error: the last output, ended by an abort
        assert status == 200
        if path == "/generate":
            assert body["meta_info"]["finish_reason"] == {"type": "abort", "message": f"ended: {cause.value}"}
        elif path == "/v1/responses":
            assert body["status"] == "cancelled"
        else:
            assert body["choices"][0]["finish_reason"] == "abort"
        return
    error = body["error"]
    assert status == http.status
    if http.status == 500:
        assert (error["type"], error["code"]) == ("internal_server_error", 500)
        assert error["message"] == f"ended: {cause.value}"
    else:
        want_type = "server_error" if http.status >= 500 else "invalid_request_error"
        assert (error["type"], error["code"]) == (want_type, http.code)


def test_a_forgotten_request_reaches_the_detokenizer_no_more(stories_path) -> None:
    from pyserve.io_struct import GenerateReqInput

    engine = make_stories_engine(stories_path, 2048)
    try:
        core = engine.core
        tm = core.tokenizer_manager
        seen: list[tuple[str, bool]] = []  # (rid, after forget) of every TokenOut emitted
        forgotten = threading.Event()
        queue = tm.detokenizer.queue
        put = queue.put_nowait

        def counting(outs):  # type: ignore[no-untyped-def]
            seen.extend((o.rid, forgotten.is_set()) for o in outs)
            put(outs)

        queue.put_nowait = counting  # type: ignore[method-assign]
        (req,) = GenerateReqInput(
            text="Once upon a time",
            stream=True,
            rid="left",
            sampling_params={"temperature": 0, "max_new_tokens": 200, "ignore_eos": True},
        ).split()
        got: list = []

        async def run() -> None:
            tm.start_stream(req, await tm.tokenize(req), got.append)
            while len(got) < 3:
                await asyncio.sleep(0.005)
            forgotten.set()  # (the loop's thread: what forget emits counts as after)
            core.forget("left")
            await asyncio.sleep(0.2)  # steps in flight finish meanwhile

        engine._call(run())
        wait_engine_idle(engine)
        before = [rid for rid, after in seen if not after]
        assert "left" in before  # it was emitted while its client listened
        assert [rid for rid, after in seen if after] == []
        assert "left" not in tm.states and "left" not in core.scheduler.reqs
        assert not got[-1].finished
    finally:
        engine.shutdown()
