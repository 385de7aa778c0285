"""/v1/tokenize and /v1/detokenize (and their short aliases) in SGLang's shapes, with exact
ids from the served tokenizer."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from pyserve.config import ServerArgs
from pyserve.server.app import create_app
from tests.conftest import CHAT_TEMPLATE

MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def tok(stories_path):
    tokenizer = AutoTokenizer.from_pretrained(stories_path)
    tokenizer.chat_template = CHAT_TEMPLATE.read_text()
    return tokenizer


@pytest.fixture(scope="module")
def client(stories_path):
    args = ServerArgs(
        model_path=str(stories_path), chat_template=str(CHAT_TEMPLATE), max_total_tokens=2048, log_level="warning"
    )
    with TestClient(create_app(args)) as c:
        yield c


@pytest.mark.parametrize("prefix", ["/v1", ""])
def test_tokenize_a_prompt_and_a_list(client, tok, prefix):
    context = client.get("/get_model_info").json()["context_length"]
    text = "Once upon a time, Lily"
    want = tok.encode(text)
    assert want[0] == tok.bos_token_id
    r = client.post(f"{prefix}/tokenize", json={"prompt": text})
    assert r.json() == {"tokens": want, "count": len(want), "max_model_len": context}
    r = client.post(f"{prefix}/tokenize", json={"prompt": [text, "a"], "add_special_tokens": False})
    lists = [tok.encode(text, add_special_tokens=False), tok.encode("a", add_special_tokens=False)]
    assert r.json() == {"tokens": lists, "count": [len(x) for x in lists], "max_model_len": context}


def test_tokenize_messages_counts_what_the_chat_route_sends(client, tok):
    want = tok.encode(
        tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    got = client.post("/v1/tokenize", json={"messages": MESSAGES}).json()
    assert got["tokens"] == want and got["count"] == len(want)
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == got["count"]


@pytest.mark.parametrize("prefix", ["/v1", ""])
def test_detokenize_round_trips(client, tok, prefix):
    ids = tok.encode("Once upon a time, Lily")
    r = client.post(f"{prefix}/detokenize", json={"tokens": ids})
    assert r.json() == {"text": tok.decode(ids)}
    r = client.post(f"{prefix}/detokenize", json={"tokens": [ids, ids[1:3]], "skip_special_tokens": True})
    assert r.json() == {"text": [tok.decode(ids, skip_special_tokens=True), tok.decode(ids[1:3])]}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/tokenize", {}, "prompt"),
        ("/v1/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/v1/tokenize", {"prompt": "a", "stream": True}, "stream"),
        ("/v1/tokenize", {"prompt": 5}, "prompt"),
        ("/v1/detokenize", {"tokens": [1, 512]}, "tokens"),
        ("/v1/detokenize", {"tokens": [[1], [-1]]}, "tokens.1"),
        ("/v1/detokenize", {"tokens": "ab"}, "tokens"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
