"""The in-process Engine on stories260k, with KV page sizes 1 and 16: sync and async
generation, streaming, seeded sampling, abort, page-aligned prefix reuse, and KV accounting
(after every test, once idle: free + evictable == pool, nothing protected)."""

from __future__ import annotations

import asyncio

import pytest

from pyserve import InvalidRequestError, ModelStepError
from tests.conftest import make_stories_engine, wait_engine_idle

POOL = 2048


@pytest.fixture(
    scope="module",
    params=[(1, False), (16, False), (1, True)],
    ids=lambda p: f"page{p[0]}" + ("-no-overlap" if p[1] else ""),
)
def engine(request, stories_path):
    """Every test here runs with overlap scheduling (pages of 1 and 16) and without it."""
    page_size, no_overlap = request.param
    eng = make_stories_engine(stories_path, POOL, page_size=page_size, disable_overlap_schedule=no_overlap)
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def no_kv_leak(engine):
    """After each test, once idle, every KV slot is free or evictable (none leaked)."""
    yield
    info = wait_engine_idle(engine)
    assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL


def test_generate_matches_reference(engine, stories_reference, stories_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    for case in stories_reference:
        out = engine.generate(
            input_ids=case["input_ids"],
            sampling_params={"temperature": 0, "max_new_tokens": case["max_new_tokens"], "ignore_eos": True},
        )
        assert out["output_ids"] == case["output_ids"]
        # the text a continuation adds to the prompt's (word-initial spaces kept)
        prompt = tok.decode(case["input_ids"], skip_special_tokens=True)
        full = tok.decode(case["input_ids"] + case["output_ids"], skip_special_tokens=True)
        assert full.startswith(prompt)
        assert out["text"] == full[len(prompt) :]
        assert out["text"].strip() == case["text"].strip()


def test_batch_more_than_max_running(engine, stories_reference):
    cases = stories_reference * 3  # 15 requests > 8 running slots: some wait, all finish
    outs = engine.generate(
        input_ids=[c["input_ids"] for c in cases],
        sampling_params=[{"temperature": 0, "max_new_tokens": 30, "ignore_eos": True} for _ in cases],
    )
    for case, out in zip(cases, outs):
        assert out["output_ids"] == case["output_ids"][:30]


def test_stream_chunks_concatenate(engine):
    params = {"temperature": 0, "max_new_tokens": 25, "ignore_eos": True}
    chunks = list(engine.generate("Once upon a time", params, stream=True))
    final = engine.generate("Once upon a time", params)
    assert chunks[-1]["text"] == final["text"]
    assert chunks[-1]["output_ids"] == final["output_ids"]
    assert len(chunks) > 1


def test_async_generate_and_stream(engine):
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}

    async def main():
        single = await engine.async_generate("The cat", params)
        chunks = [c async for c in await engine.async_generate("The cat", params, stream=True)]
        return single, chunks

    single, chunks = asyncio.run(main())
    assert chunks[-1]["output_ids"] == single["output_ids"]
    assert len(single["output_ids"]) == 10


def test_seeded_sampling_is_reproducible(engine):
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 20, "seed": 7, "ignore_eos": True}
    a = engine.generate("The dog", params)
    b = engine.generate(["The dog", "A bird flew"], [params, {**params, "seed": 8}])[0]
    assert a["output_ids"] == b["output_ids"]


def test_stop_token_and_max_new_tokens_zero(engine, stories_reference):
    case = stories_reference[0]
    stop_at = case["output_ids"][5]
    out = engine.generate(
        input_ids=case["input_ids"],
        sampling_params={"temperature": 0, "max_new_tokens": 50, "stop_token_ids": [stop_at], "ignore_eos": True},
    )
    first = case["output_ids"].index(stop_at)
    assert out["output_ids"] == case["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    zero = engine.generate("Hi", {"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_invalid_request_raises_typed_error(engine):
    with pytest.raises(InvalidRequestError) as exc:
        engine.generate(input_ids=[1] * 600)
    assert exc.value.code == "context_length_exceeded"
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_prompt_plus_max_new_tokens_beyond_the_context_is_refused(engine):
    """An explicit max_new_tokens that cannot fit is refused before the request is queued (as
    SGLang, vLLM and OpenAI do), not silently cut short; the default (128) is cut to the room
    left, as SGLang does."""
    ctx = engine.core.context_len
    prompt = [1] + [7] * (ctx - 11)  # ctx - 10 tokens
    with pytest.raises(InvalidRequestError) as exc:
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 11})
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "max_new_tokens"
    assert str(exc.value).startswith(f"requested {ctx + 1} tokens ({ctx - 10} of prompt + 11 max_new_tokens)")
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 10, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 10  # exactly the context: allowed
    # without max_new_tokens: the default is cut to the room left
    assert (
        engine.generate(input_ids=prompt, sampling_params={"ignore_eos": True})["meta_info"]["completion_tokens"] == 10
    )


def test_abort_frees_kv_and_idle_accounting(engine):
    async def stream_then_drop():
        agen = await engine.async_generate("Tim", {"max_new_tokens": 300, "ignore_eos": True}, stream=True)
        got = 0
        async for _ in agen:
            got += 1
            if got == 3:
                break
        await agen.aclose()
        return got

    assert asyncio.run(stream_then_drop()) == 3
    info = wait_engine_idle(engine)
    assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL


def test_prefix_cache_reports_page_aligned_cached_tokens(engine, stories_reference):
    page_size = engine.get_server_info()["page_size"]
    prefix = list(range(5, 105))  # 101 shared tokens with the leading 1
    engine.generate(input_ids=[1] + prefix + [7], sampling_params={"max_new_tokens": 1})
    out = engine.generate(input_ids=[1] + prefix + [9], sampling_params={"max_new_tokens": 1})
    assert out["meta_info"]["cached_tokens"] == {1: 101, 16: 96}[page_size]
    # Greedy output with a cached prefix equals the reference computed from scratch.
    case = stories_reference[0]
    params = {"temperature": 0, "max_new_tokens": case["max_new_tokens"], "ignore_eos": True}
    engine.generate(input_ids=case["input_ids"], sampling_params=params)
    again = engine.generate(input_ids=case["input_ids"], sampling_params=params)
    assert again["output_ids"] == case["output_ids"]
    assert again["meta_info"]["cached_tokens"] == (len(case["input_ids"]) - 1) // page_size * page_size


def test_a_step_that_panics_fails_its_requests_and_the_engine_goes_on(engine, monkeypatch):
    """A native kernel's panic reaches Python as pyo3's PanicException, a BaseException: the
    step's requests fail with ModelStepError, the worker thread survives, the next request runs."""

    class FakePanic(BaseException):
        pass

    runner = engine.core.model_runner
    forward = runner.forward

    def panicking(batch):
        monkeypatch.setattr(runner, "forward", forward)  # only this one step fails
        raise FakePanic("kernel panicked")

    monkeypatch.setattr(runner, "forward", panicking)
    with pytest.raises(ModelStepError, match="^model step failed: FakePanic: kernel panicked$"):
        engine.generate("Once upon a time", {"temperature": 0, "max_new_tokens": 4})
    again = engine.generate("Once upon a time", {"temperature": 0, "max_new_tokens": 4})
    assert again["meta_info"]["completion_tokens"] == 4
