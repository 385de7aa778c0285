"""An empty input gets no embedding: `""`, `[]`, `[""]` and an empty token-id list are 400s
naming the field on /v1/embeddings (param "input", as the OpenAI API refuses them) and /encode
(its `text` or `input_ids`), and `InvalidRequestError` (param "input") from the Python `Engine`;
whitespace is text and still embeds. stories260k served with --is-embedding."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from pyserve.config import ServerArgs
from pyserve.errors import InvalidRequestError
from pyserve.server.app import create_app
from tests.conftest import make_stories_engine, wait_engine_idle

HINT = "an embedding needs at least one character of text or one token id"


@pytest.fixture(scope="module")
def client(stories_path):
    args = ServerArgs(model_path=str(stories_path), is_embedding=True, max_total_tokens=1024, log_level="warning")
    with TestClient(create_app(args)) as c:
        yield c


@pytest.fixture(scope="module")
def engine(stories_path):
    engine = make_stories_engine(stories_path, 1024, is_embedding=True, log_level="warning")
    yield engine
    engine.shutdown()


def refusal(param: str, problem: str) -> dict:
    message = f"{param}: {problem}; {HINT}"
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", "the text is empty"),
        ([], "the list is empty"),
        ([""], "item 0 is an empty text"),
        (["Once upon a time", ""], "item 1 is an empty text"),
        ([[]], "item 0 is an empty token-id list"),
        ([[1, 5], []], "item 1 is an empty token-id list"),
    ],
)
def test_v1_embeddings_refuses_an_empty_input(client, value, problem):
    r = client.post("/v1/embeddings", json={"input": value})
    assert r.status_code == 400
    assert r.json() == refusal("input", problem)


@pytest.mark.parametrize(
    ("body", "param", "problem"),
    [
        ({"text": ""}, "text", "the text is empty"),
        ({"text": ["a", ""]}, "text", "item 1 is an empty text"),
        ({"text": []}, "text", "the list is empty"),
        ({"input_ids": []}, "input_ids", "the list is empty"),
        ({"input_ids": [[1], []]}, "input_ids", "item 1 is an empty token-id list"),
    ],
)
def test_encode_refuses_an_empty_input(client, body, param, problem):
    r = client.post("/encode", json=body)
    assert r.status_code == 400
    assert r.json() == refusal(param, problem)


def test_whitespace_is_text_and_embeds(client, stories_path):
    tokenizer = AutoTokenizer.from_pretrained(str(stories_path))
    r = client.post("/v1/embeddings", json={"input": [" ", "Lily"]})
    assert r.status_code == 200
    data = r.json()
    assert [(d["index"], len(d["embedding"])) for d in data["data"]] == [(0, 64), (1, 64)]  # hidden size 64
    assert data["usage"]["prompt_tokens"] == len(tokenizer(" ")["input_ids"]) + len(tokenizer("Lily")["input_ids"])


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({"prompt": ""}, "the text is empty"),
        ({"prompt": []}, "the list is empty"),
        ({"prompt": ["Lily", ""]}, "item 1 is an empty text"),
        ({"input_ids": []}, "the list is empty"),
        ({"input_ids": [[]]}, "the token-id list is empty"),
        ({"input_ids": [[1, 5], []]}, "item 1 is an empty token-id list"),
    ],
)
def test_engine_encode_raises_for_an_empty_input(engine, args, problem):
    with pytest.raises(InvalidRequestError) as info:
        engine.encode(**args)
    assert (str(info.value), info.value.param, info.value.status) == (f"input: {problem}; {HINT}", "input", 400)
    idle = wait_engine_idle(engine)  # nothing was admitted
    assert idle["kv_free_slots"] + idle["kv_evictable_slots"] == 1024


def test_engine_encode_embeds_whitespace(engine):
    out = engine.encode(" ")
    assert (len(out["embedding"]), out["meta_info"]["prompt_tokens"]) == (64, 3)  # " " is [BOS, 410, 410]
