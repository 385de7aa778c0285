"""The server's --stream-interval: a streamed request gets a chunk every N tokens (and the
last one), unless it asks for its own stream_interval; the text is the same as unstreamed."""

from __future__ import annotations

import pytest

from tests.conftest import make_stories_engine, wait_engine_idle


@pytest.fixture(scope="module")
def engine(stories_path):
    eng = make_stories_engine(stories_path, 2048, stream_interval=3)
    yield eng
    eng.shutdown()


def test_server_stream_interval_and_per_request_override(engine):
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    chunks = list(engine.generate("Once upon a time", params, stream=True))
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [3, 6, 8]
    whole = engine.generate("Once upon a time", params)
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    own = list(engine.generate("Once upon a time", {**params, "stream_interval": 5}, stream=True))
    assert [c["meta_info"]["completion_tokens"] for c in own] == [5, 8]
    assert own[-1]["text"] == whole["text"]


def test_a_sink_stream_left_by_its_client_leaves_nothing_behind(engine):
    """The /generate streaming fast path (TokenizerManager.start_stream): a client that leaves
    mid-stream aborts the request; its rid is free again and its KV and rows are released."""
    import asyncio

    from pyserve.io_struct import GenerateReqInput

    core = engine.core
    tm = core.tokenizer_manager
    req = GenerateReqInput(
        text="Once upon a time",
        stream=True,
        rid="left",
        sampling_params={"temperature": 0, "max_new_tokens": 200, "ignore_eos": True},
    ).split()[0]
    got: list = []

    async def run() -> None:
        tm.start_stream(req, await tm.tokenize(req), got.append)
        while len(got) < 3:
            await asyncio.sleep(0.005)
        tm.forget("left")  # what StreamResponse does when the client disconnects

    engine._call(run())
    wait_engine_idle(engine)
    assert "left" not in tm.states and "left" not in core.scheduler.reqs
    assert not got[-1].finished  # the consumer that left is not written to any more
    again = engine.generate("Once upon a time", {"temperature": 0, "max_new_tokens": 2}, rid="left")
    assert again["meta_info"]["id"] == "left"
