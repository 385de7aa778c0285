"""End to end on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF): a real server started
with no --model-path, the official openai client, exact greedy parity with HF transformers on
the same dequantized weights (`--quantization none`: the float32 path; the quantized kernels'
int8 activations change near-tied greedy choices, see tests/e2e/test_gguf_vs_llamacpp.py), and
prefix reuse."""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_server
from tests.hf_reference import hf_greedy, smollm2_gguf

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a short poem about the sea:",
    "Q: What is 12 times 12?\nA:",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "import numpy as np\n\ndef softmax(x):",
    "The largest planet in our solar system is",
    "Translate to French: Good morning, my friend.",
    "List three fruits: apples,",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory, "smollm2", ["--max-total-tokens", "32768", "--quantization", "none"])
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
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        timeout=120,
        json={"model": "default", "messages": QUESTION, "temperature": 0, "max_tokens": 48},
    )
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
    stream = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
    )
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


def test_greedy_equals_hf_transformers(server, smollm2_hf_model, smollm2_hf_tokenizer):
    """10 prompts x 64 tokens in one batched request equal HF's greedy ids. The HF ids of all 10
    are stored (tests/data/make_smollm2_reference.py regenerates them; HF takes minutes on a
    CPU); the first prompt is also re-run through HF live, so the stored file cannot go stale."""
    import json

    ref_path = Path(__file__).resolve().parents[1] / "data" / "smollm2_greedy_reference.json"
    cases = json.loads(ref_path.read_text())["cases"]
    assert [c["prompt"] for c in cases] == PROMPTS and len(PROMPTS) == 10
    outs = httpx.post(
        server.base_url + "/generate",
        timeout=600,
        json={"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}},
    ).json()
    for case, out in zip(cases, outs):
        assert out["meta_info"]["prompt_tokens"] == len(case["input_ids"])
        assert out["output_ids"] == case["output_ids"], case["prompt"]
    for case in cases[:1]:
        assert smollm2_hf_tokenizer(case["prompt"]).input_ids == case["input_ids"]
        assert hf_greedy(smollm2_hf_model, case["input_ids"], 64) == case["output_ids"]


def test_greedy_equals_hf_without_overlap_schedule():
    """The same 10 prompts through an in-process Engine with --disable-overlap-schedule: the
    stored HF greedy ids again (overlap changes when steps are planned, never the tokens)."""
    import json

    from pyserve import Engine

    cases = json.loads((Path(__file__).resolve().parents[1] / "data" / "smollm2_greedy_reference.json").read_text())[
        "cases"
    ]
    engine = Engine(
        model_path=str(smollm2_gguf()), max_total_tokens=8192, disable_overlap_schedule=True, quantization="none"
    )
    try:
        assert engine.core.scheduler.overlap is False
        outs = engine.generate(
            input_ids=[c["input_ids"] for c in cases],
            sampling_params={"temperature": 0, "max_new_tokens": 64, "ignore_eos": True},
        )
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in outs] == [c["output_ids"] for c in cases]


@pytest.mark.parametrize("mixed", [False, True], ids=["turns", "mixed"])
def test_greedy_equals_hf_with_small_prefill_chunks(mixed):
    """The same 10 prompts (5-15 tokens) with --chunked-prefill-size 3: every prompt is
    prefilled in chunks (the two longest, 12 and 15 tokens, in 4 and 5), taking turns with
    the others' decode steps, or (--enable-mixed-chunk) carrying them; the stored HF greedy
    ids again."""
    import json

    from pyserve import Engine

    cases = json.loads((Path(__file__).resolve().parents[1] / "data" / "smollm2_greedy_reference.json").read_text())[
        "cases"
    ]
    assert sorted(len(c["input_ids"]) for c in cases)[-2:] == [12, 15]  # 4x and 5x the chunk
    engine = Engine(
        model_path=str(smollm2_gguf()),
        max_total_tokens=8192,
        chunked_prefill_size=3,
        enable_mixed_chunk=mixed,
        quantization="none",
    )
    try:
        assert engine.core.scheduler.chunked_prefill_size == 3
        outs = engine.generate(
            input_ids=[c["input_ids"] for c in cases],
            sampling_params={"temperature": 0, "max_new_tokens": 64, "ignore_eos": True},
        )
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in outs] == [c["output_ids"] for c in cases]


def test_chat_logprobs_template_and_stream(server, client, smollm2_hf_model, smollm2_hf_tokenizer):
    tok = smollm2_hf_tokenizer
    model = client.models.list().data[0].id
    full = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3
    )
    # the prompt is exactly the tokenizer's chat template
    template = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    template_ids = tok(template, add_special_tokens=False).input_ids
    assert full.usage.prompt_tokens == len(template_ids)
    native = httpx.post(
        server.base_url + "/generate",
        timeout=120,
        json={"input_ids": template_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 12}},
    ).json()
    assert native["text"] == full.choices[0].message.content
    content = full.choices[0].logprobs.content
    assert full.choices[0].finish_reason == "stop" and content[-1].token == "<|im_end|>"  # EOS has one too
    assert "".join(c.token for c in content[:-1]) == full.choices[0].message.content
    for c in content:
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert bytes(c.bytes).decode() == c.token
    # logprob of each token equals HF's log_softmax on the same sequence
    import torch

    hf = smollm2_hf_model
    out_ids = tok(full.choices[0].message.content, add_special_tokens=False).input_ids
    seq = list(template_ids) + out_ids[: len(content)]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0], dim=-1)
    n = len(template_ids)
    for k, c in enumerate(content[: len(out_ids)]):
        assert abs(c.logprob - float(ref[n - 1 + k, seq[n + k]])) < 1e-4
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    # the second request reuses the cached prompt: same values up to float rounding
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))


def test_shared_prefix_is_reused(server):
    shared = " ".join(f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(60))
    first = httpx.post(
        server.base_url + "/generate",
        timeout=120,
        json={"text": shared + " Question one?", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    ).json()
    assert first["meta_info"]["prompt_tokens"] >= 500
    second = httpx.post(
        server.base_url + "/generate",
        timeout=120,
        json={"text": shared + " A different question?", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    ).json()
    assert second["meta_info"]["cached_tokens"] >= 480
    assert second["meta_info"]["cached_tokens"] < second["meta_info"]["prompt_tokens"]


def test_16_concurrent_chat_streams(client):
    model = client.models.list().data[0].id
    questions = [
        [{"role": "user", "content": f"Name one animal that starts with the letter {c}."}] for c in "ABCDEFGHIJKLMNOP"
    ]

    def streamed(messages):
        stream = client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=24, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with cf.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(streamed, questions))
    for messages, text in zip(questions, texts):
        full = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
        assert text == full.choices[0].message.content


def test_text_equals_decode_of_prompt_plus_output(server, smollm2_hf_tokenizer):
    """Byte-level BPE: for 20 prompts, every route's text (streamed or not) equals the
    tokenizer's decode of prompt + output minus that of the prompt; echo equals decode(prompt)."""
    from tests.e2e.text_exact import check_all

    check_all(server.base_url, smollm2_hf_tokenizer, max_new=8, workers=8)
