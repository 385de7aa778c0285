"""The server's --stream-interval: a streamed request gets a chunk every N tokens (and the
last one), unless it asks for its own stream_interval; the text is the same as unstreamed."""

from __future__ import annotations

import pytest

from tests.conftest import make_stories_engine


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
