"""The Responses API's stream encoder and the route's ends other than a finished reply: the
exact events of a streamed response (every event `event:` + `data:`, sequence numbers from 0,
text needing escapes), a model step failing after the first event (`response.failed` with the
text so far) or before it (a plain 500), and /abort_request mid-stream (status "cancelled").
The app runs in process on a simulated device (seeded ids, never EOS) with stories260k's
tokenizer."""

from __future__ import annotations

import json
import threading
import time

import pytest
from starlette.testclient import TestClient

from pyserve.config import ServerArgs
from pyserve.forward_batch_info import EndCause, FinishReason
from pyserve.io_struct import GenerateOutput
from pyserve.model_executor.simulated_runner import SimulatedRunner
from pyserve.model_loader.tokenizer import get_tokenizer
from pyserve.server.app import create_app
from pyserve.server.openai.responses_stream import ResponseHead, ResponsesStreamEncoder
from pyserve.server.render import json_bytes
from tests.conftest import CHAT_TEMPLATE, is_idle

POOL = 16384
DELTAS = ["Hel", "", 'lo "w"\n', "\udcff", "\x00 日本", "!"]
ECHO = {"instructions": None, "temperature": 1.0}


def outputs(finish: FinishReason) -> list[GenerateOutput]:
    outs, text = [], ""
    for k, delta in enumerate(DELTAS):
        text += delta
        outs.append(
            GenerateOutput(
                rid="r",
                text=text,
                text_delta=delta,
                output_ids=list(range(k + 1)),
                ids_delta=[k],
                prompt_tokens=5,
                cached_tokens=2,
                finish_reason=finish if k == len(DELTAS) - 1 else None,
            )
        )
    return outs


def response(status: str, output: list, usage, details=None, error=None) -> dict:
    return {
        "id": "resp_r",
        "object": "response",
        "created_at": 7,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": details,
        "model": "m",
        "output": output,
        "previous_response_id": None,
        "store": False,
        **ECHO,
        "usage": usage,
    }


def item(status: str, text: str | None) -> dict:
    content = [] if text is None else [part(text)]
    return {"type": "message", "id": "msg_r", "status": status, "role": "assistant", "content": content}


def part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


USAGE = {
    "input_tokens": 5,
    "input_tokens_details": {"cached_tokens": 2},
    "output_tokens": 6,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 11,
}


def sse(events: list[tuple[str, dict]]) -> bytes:
    return b"".join(
        b"event: " + name.encode() + b"\ndata: " + json_bytes({"type": name, "sequence_number": k, **data}) + b"\n\n"
        for k, (name, data) in enumerate(events)
    )


@pytest.mark.parametrize(
    ("finish", "status", "details", "last"),
    [
        (FinishReason.stop("!"), "completed", None, "response.completed"),
        (FinishReason.length_limit(6), "incomplete", {"reason": "max_output_tokens"}, "response.incomplete"),
        (FinishReason.abort(EndCause.ABORTED, "aborted"), "cancelled", None, "response.incomplete"),
    ],
)
def test_events_are_exactly_the_responses_apis(finish, status, details, last):
    encoder = ResponsesStreamEncoder(ResponseHead("resp_r", "msg_r", 7, "m", ECHO))
    got = b"".join(encoder(o) for o in outputs(finish)) + encoder.end()
    text = "".join(DELTAS)
    where = {"item_id": "msg_r", "output_index": 0, "content_index": 0}
    final = item("completed" if status == "completed" else "incomplete", text)
    running = response("in_progress", [], None)
    want = [
        ("response.created", {"response": running}),
        ("response.in_progress", {"response": running}),
        ("response.output_item.added", {"output_index": 0, "item": item("in_progress", None)}),
        ("response.content_part.added", {**where, "part": part("")}),
        *[("response.output_text.delta", {**where, "delta": d, "logprobs": []}) for d in DELTAS if d],
        ("response.output_text.done", {**where, "text": text, "logprobs": []}),
        ("response.content_part.done", {**where, "part": part(text)}),
        ("response.output_item.done", {"output_index": 0, "item": final}),
        (last, {"response": response(status, [final], USAGE, details)}),
    ]
    assert got == sse(want)


class Served:
    """create_app on a SimulatedRunner, in process (TestClient)."""

    def __init__(self, stories_path) -> None:
        tok = get_tokenizer(str(stories_path))
        self.runner = SimulatedRunner(len(tok), {tok.eos_token_id}, POOL, 4096, decode_base_ms=1.0)
        args = ServerArgs(
            model_path=str(stories_path),
            max_total_tokens=POOL,
            chat_template=str(CHAT_TEMPLATE),
            log_level="warning",
            stats_interval_s=3600.0,
        )
        self.client = TestClient(create_app(args, model_runner=self.runner))

    def stream(self, body: dict) -> tuple[int, list]:
        """Status and events of a streamed response: (name, data) pairs ("[DONE]" for a
        `data: [DONE]`, which the Responses API does not send)."""
        r = self.client.post("/v1/responses", json={**body, "stream": True})
        if r.status_code != 200:
            return r.status_code, [r.json()]
        events: list = []
        for block in r.text.split("\n\n"):
            if block == "data: [DONE]":
                events.append("[DONE]")
            elif block:
                name, data = block.split("\n")
                events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        return r.status_code, events


@pytest.fixture(scope="module")
def served(stories_path):
    srv = Served(stories_path)
    with srv.client:
        yield srv
        deadline = time.monotonic() + 30
        while not is_idle(info := srv.client.get("/get_server_info").json()):
            assert time.monotonic() < deadline, info
            time.sleep(0.05)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL


def failing_on_step(runner, step: int):
    """runner.forward raising on its `step`-th call from now; returns the original."""
    forward, calls = runner.forward, {"n": 0}

    def failing(batch):
        calls["n"] += 1
        if calls["n"] == step:
            raise RuntimeError("device lost")
        return forward(batch)

    runner.forward = failing
    return forward


def test_a_failed_step_after_the_first_event_ends_with_response_failed(served):
    forward = failing_on_step(served.runner, 4)
    try:
        status, events = served.stream({"input": "Hi", "max_output_tokens": 20})
    finally:
        served.runner.forward = forward
    assert status == 200 and "[DONE]" not in events
    names = [name for name, _ in events]
    num_deltas = len(names) - 5
    assert num_deltas >= 1
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added"] + [
        "response.content_part.added"
    ]
    assert names[4:] == ["response.output_text.delta"] * num_deltas + ["response.failed"]
    text = "".join(data["delta"] for name, data in events[4:-1])
    failed = events[-1][1]
    assert failed["sequence_number"] == len(names) - 1
    got = failed["response"]
    assert got["status"] == "failed" and got["id"] == events[0][1]["response"]["id"]
    assert got["error"] == {"code": "server_error", "message": "model step failed: device lost", "param": None}
    assert got["output"][0]["status"] == "incomplete" and got["output"][0]["content"][0]["text"] == text
    assert got["usage"]["output_tokens"] >= 1


def test_a_failed_first_step_is_a_plain_500(served):
    forward = failing_on_step(served.runner, 1)
    try:
        status, events = served.stream({"input": "Hi", "max_output_tokens": 20})
    finally:
        served.runner.forward = forward
    assert status == 500
    assert events == [
        {
            "error": {
                "message": "model step failed: device lost",
                "type": "internal_server_error",
                "param": None,
                "code": 500,
            }
        }
    ]


def test_an_abort_mid_stream_ends_cancelled(served):
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.update(events=served.stream({"input": "Hi", "max_output_tokens": 3000})[1])
    )
    thread.start()
    deadline = time.monotonic() + 30
    while served.client.get("/get_server_info").json()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert served.client.post("/abort_request", json={"abort_all": True}).json()["num_aborted"] == 1
    thread.join(timeout=60)
    events = result["events"]
    assert "[DONE]" not in events and events[-1][0] == "response.incomplete"
    got = events[-1][1]["response"]
    assert got["status"] == "cancelled" and got["incomplete_details"] is None and got["error"] is None
    assert got["output"][0]["status"] == "incomplete" and got["usage"]["output_tokens"] < 3000
