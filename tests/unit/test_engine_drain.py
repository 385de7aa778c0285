"""Engine.shutdown drains as `pyserve serve` does on SIGTERM: a running stream may finish
within shutdown_timeout_s, else it ends with finish reason abort; new requests get
ServerDrainingError meanwhile; nothing is left holding KV."""

from __future__ import annotations

import threading
import time

import pytest

from pyserve import Engine
from pyserve.errors import ServerDrainingError


def _stream_until_started(engine: Engine, max_new_tokens: int) -> tuple[list[dict], threading.Thread]:
    chunks: list[dict] = []

    def consume() -> None:
        params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        for chunk in engine.generate("Once upon a time", params, stream=True):
            chunks.append(chunk)

    thread = threading.Thread(target=consume)
    thread.start()
    deadline = time.monotonic() + 30
    while len(chunks) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return chunks, thread


@pytest.mark.parametrize("timeout_s, finished_by", [(30.0, "length"), (0.05, "abort")])
def test_shutdown_lets_a_stream_finish_or_ends_it(stories_path, timeout_s, finished_by):
    engine = Engine(model_path=str(stories_path), max_total_tokens=2048, shutdown_timeout_s=timeout_s)
    chunks, thread = _stream_until_started(engine, 300 if finished_by == "length" else 480)
    refused: list[BaseException] = []

    def late_request() -> None:
        time.sleep(0.02)  # (within the drain)
        try:
            engine.generate("hi", {"max_new_tokens": 1})
        except BaseException as exc:
            refused.append(exc)

    late = threading.Thread(target=late_request)
    late.start()
    engine.shutdown()
    thread.join(timeout=30)
    late.join(timeout=30)
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"]["type"] == finished_by
    if finished_by == "abort":
        assert last["finish_reason"]["message"] == "server shutting down"
        assert last["completion_tokens"] < 480
        assert len(refused) == 1  # (within the drain, or after the engine stopped)
    else:
        assert last["completion_tokens"] == 300
        assert len(refused) == 1 and isinstance(refused[0], ServerDrainingError)  # the drain lasted ~1 s
