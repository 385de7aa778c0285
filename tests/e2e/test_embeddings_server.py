"""/v1/embeddings and /encode on a server of all-MiniLM-L6-v2, through HTTP, the `openai`
client and langchain's `OpenAIEmbeddings` (client venv): values equal to sentence-transformers'
(cosine >= 0.99999), base64 equal to float, token-id input, `dimensions` refused for a model
not trained for it and exact (truncated, normalised again) with --is-matryoshka, SGLang's
/encode shapes, `is_generation` in /v1/models and /get_model_info, clear 400s (generation on
an embedding server and the reverse, too long, bad fields); afterwards no KV or row held."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import REPO, run_client, start_server, wait_idle
from tests.unit.test_embeddings_engine import SENTENCES, minilm_path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory, "minilm", ["--model-path", minilm_path()])
    try:
        yield srv
        info = wait_idle(srv.base_url)
        assert info["kv_free_slots"] == info["max_total_num_tokens"], info  # an encoder keeps no KV
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def st_vectors() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path(), device="cpu").encode(SENTENCES, convert_to_numpy=True)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def vectors_of(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.array([d["embedding"] for d in data], dtype=np.float32)


def test_float_embeddings_equal_sentence_transformers(server, st_vectors) -> None:
    r = post(server, "/v1/embeddings", {"model": "model", "input": SENTENCES})
    got = vectors_of(r)
    cosines = (got * st_vectors).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(st_vectors, axis=1))
    assert cosines.min() >= 0.99999, cosines
    body = r.json()
    assert body["object"] == "list" and body["model"] == "model"
    assert body["data"][0]["object"] == "embedding"
    tokens = httpx.post(server.base_url + "/v1/tokenize", json={"prompt": SENTENCES}).json()["count"]
    assert body["usage"] == {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}


def test_base64_token_ids_and_the_openai_client(server) -> None:
    floats = vectors_of(post(server, "/v1/embeddings", {"input": ["hello world", "yes"]}))
    b64 = post(server, "/v1/embeddings", {"input": ["hello world", "yes"], "encoding_format": "base64"}).json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64["data"]])
    assert np.array_equal(decoded, floats)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    default = client.embeddings.create(model="model", input=["hello world", "yes"])  # base64 on the wire
    as_float = client.embeddings.create(model="model", input=["hello world", "yes"], encoding_format="float")
    for a, b, f in zip(default.data, as_float.data, floats):
        assert np.abs(np.array(a.embedding) - np.array(b.embedding)).max() <= 1e-6
        assert np.abs(np.array(b.embedding) - f).max() <= 1e-6
    ids = httpx.post(server.base_url + "/v1/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    for body_input in (ids, [ids]):
        one = vectors_of(post(server, "/v1/embeddings", {"input": body_input}))
        assert one.shape == (1, 384) and np.abs(one[0] - floats[0]).max() <= 1e-6


def test_langchain_openai_embeddings(server, client_python, tmp_path) -> None:
    texts = ["hello world", "The cat sits outside"]
    out = run_client(
        client_python,
        [str(REPO / "tests" / "clients" / "embedding_clients.py"), server.base_url, "model", *texts],
        tmp_path,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    ref = vectors_of(post(server, "/v1/embeddings", {"input": texts}))
    assert np.abs(np.array(got["documents"]) - ref).max() <= 1e-6
    assert np.abs(np.array(got["query"]) - ref[0]).max() <= 1e-6


def test_native_encode(server) -> None:
    one = post(server, "/encode", {"text": "hello world", "rid": "enc-1"}).json()
    assert np.round(one["embedding"][:4], 4).tolist() == [-0.0345, 0.0310, 0.0067, 0.0261]
    assert one["meta_info"]["id"] == "enc-1" and one["meta_info"]["prompt_tokens"] == 4
    many = post(server, "/encode", {"input_ids": [[101, 7592, 2088, 102], [101, 2748, 102]]}).json()
    assert [len(m["embedding"]) for m in many] == [384, 384]
    assert np.abs(np.array(many[0]["embedding"]) - np.array(one["embedding"])).max() <= 1e-6


def test_kind_and_refusals(server) -> None:
    assert httpx.get(server.base_url + "/v1/models").json()["data"][0]["is_generation"] is False
    assert httpx.get(server.base_url + "/get_model_info").json()["is_generation"] is False
    cases = [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, "model", "this server serves an embedding model"),
        ("/generate", {"text": "hello"}, "model", "this server serves an embedding model"),
        ("/v1/embeddings", {"input": "hello", "dimensions": 64}, "dimensions", "does not support matryoshka"),
        ("/v1/embeddings", {"input": "word " * 300}, "input", "the input has 302 tokens; this model's context"),
        ("/v1/embeddings", {"input": []}, None, "input"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, None, "encoding_format"),
        ("/v1/embeddings", {"input": [[101, 99999]]}, "input", "outside the vocabulary"),
        ("/v1/embeddings", {"input": "x", "model": "other"}, "model", "does not exist"),
        ("/encode", {"text": "x", "input_ids": [1]}, "text", "give either text or input_ids"),
    ]
    for path, body, param, message in cases:
        r = post(server, path, body)
        assert r.status_code == (404 if body.get("model") == "other" else 400), (path, body, r.text)
        error = r.json()["error"]
        assert message in error["message"] or message in str(error.get("param")), (path, body, error)
        if param is not None:
            assert error["param"] == param, (path, body, error)
    assert post(server, "/v1/embeddings", {"input": "still serving"}).status_code == 200


def test_dimensions_on_a_matryoshka_server(tmp_path_factory) -> None:
    srv = start_server(tmp_path_factory, "minilm-mrl", ["--model-path", minilm_path(), "--is-matryoshka"])
    try:
        full = vectors_of(post(srv, "/v1/embeddings", {"input": ["hello world", "yes"]}))
        cut = vectors_of(post(srv, "/v1/embeddings", {"input": ["hello world", "yes"], "dimensions": 64}))
        ref = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
        assert cut.shape == (2, 64) and np.abs(cut - ref).max() <= 1e-6
        r = post(srv, "/v1/embeddings", {"input": "x", "dimensions": 385})
        assert r.status_code == 400 and r.json()["error"]["message"] == "dimensions 385 is not supported: at most 384"
    finally:
        srv.stop()


def test_a_generation_server_refuses_embeddings(tmp_path_factory, stories_path) -> None:
    args = ["--model-path", str(stories_path), "--max-total-tokens", "512"]
    srv = start_server(tmp_path_factory, "stories-gen", args)
    try:
        r = post(srv, "/v1/embeddings", {"input": "Once upon a time"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        assert "this server generates text: embeddings need" in r.json()["error"]["message"]
        assert httpx.get(srv.base_url + "/v1/models").json()["data"][0]["is_generation"] is True
    finally:
        srv.stop()


def _bench(args: list[str], out) -> dict:
    from pyserve.bench.cli import main as bench_main

    assert bench_main([*args, "--output-file", str(out)]) == 0
    return json.loads(out.read_text().splitlines()[-1])


def test_bench_serve_and_offline_on_an_embedding_model(server, tmp_path) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"prompt": s, "output_len": 1}) + "\n" for s in SENTENCES))
    common = ["--dataset-name", "jsonl", "--dataset-path", str(workload), "--num-prompts", "20"]
    serve = _bench(
        ["serve", "--backend", "openai-embeddings", "--base-url", server.base_url, "--max-concurrency", "4"]
        + ["--disable-tqdm", *common],
        tmp_path / "serve.jsonl",
    )
    tokens = sum(httpx.post(server.base_url + "/v1/tokenize", json={"prompt": SENTENCES}).json()["count"])
    m = serve["metrics"]
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (20, 0, tokens, 0)
    assert serve["token_count_source"] == "usage" and m["e2e_ms"]["median"] > 0
    args = ["offline", "--model-path", minilm_path(), "--log-level", "warning", *common]
    offline = _bench(args, tmp_path / "o.jsonl")
    m = offline["metrics"]
    assert (m["num_requests"], m["total_input_tokens"], m["total_output_tokens"]) == (20, tokens, 0)
