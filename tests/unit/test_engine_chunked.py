"""Chunked prefill on stories260k: prompts of 4x-8x the chunk size give HF's greedy tokens
(a greedy continuation of a prefix of HF's greedy output is the rest of that output), alone
and batched with short requests, with pages of 1 and 16, without overlap and with mixed
chunks (the running requests' decode tokens inside the prefill steps); the engine's
default follows the device (CPU: 8192); no KV leak."""

from __future__ import annotations

import asyncio

import pytest

from pyserve import Engine
from tests.conftest import make_stories_engine, wait_engine_idle

POOL = 2048


@pytest.fixture(
    scope="module",
    params=[
        (1, 16, False, False),
        (16, 32, False, False),
        (1, 16, True, False),
        (1, 16, False, True),
        (16, 32, True, True),
    ],
    ids=lambda p: f"page{p[0]}-chunk{p[1]}" + ("-no-overlap" if p[2] else "") + ("-mixed" if p[3] else ""),
)
def engine(request, stories_path):
    page_size, chunk, no_overlap, mixed = request.param
    eng = make_stories_engine(
        stories_path,
        POOL,
        page_size=page_size,
        chunked_prefill_size=chunk,
        disable_overlap_schedule=no_overlap,
        enable_mixed_chunk=mixed,
    )
    eng.chunk = chunk
    yield eng
    eng.shutdown()


def test_long_prompts_give_the_reference_tokens(engine, stories_reference, monkeypatch):
    assert engine.core.scheduler.chunked_prefill_size == engine.chunk
    worker = engine.core.scheduler.worker
    extends: list[int] = []
    submit = worker.submit

    def recording_submit(plan, done=None):  # the engine's loop thread
        if plan.extend_lens is not None:
            extends.append(int(plan.extend_lens.sum()))
        return submit(plan, done)

    monkeypatch.setattr(worker, "submit", recording_submit)
    case = stories_reference[0]  # 1 prompt token, 200 greedy output tokens
    ids, outs = case["input_ids"], case["output_ids"]
    # prompts of 4x and 8x the chunk (5x for chunks of 32: the reference has 200 tokens)
    cuts = [4 * engine.chunk - 1, (8 if engine.chunk == 16 else 5) * engine.chunk - 1]
    prompts = [ids + outs[:k] for k in cuts] + [c["input_ids"] for c in stories_reference[1:]]
    results = engine.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    )
    for k, res in zip(cuts, results):
        assert res["output_ids"] == outs[k : k + 40]
        assert res["meta_info"]["prompt_tokens"] == 1 + k
    for c, res in zip(stories_reference[1:], results[2:]):
        assert res["output_ids"] == c["output_ids"][:40]
    # every extend step computed at most one chunk (plus, mixed, one token per decoding
    # request), and the long prompts took several
    most = engine.chunk + (len(prompts) if engine.core.scheduler.enable_mixed_chunk else 0)
    assert engine.chunk <= max(extends) <= most and len(extends) >= 1 + cuts[1] // engine.chunk
    # once more: the chunks' pages were cached, so the long prompts are mostly reused
    again = engine.generate(
        input_ids=prompts[0], sampling_params={"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    )
    assert again["output_ids"] == outs[cuts[0] : cuts[0] + 40]
    assert again["meta_info"]["cached_tokens"] >= 3 * engine.chunk
    info = wait_engine_idle(engine)
    assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL


def test_a_stream_keeps_its_tokens_coming_while_a_long_prompt_is_chunked(engine, stories_reference):
    case = stories_reference[0]
    cut = 5 * engine.chunk - 1
    long_prompt = case["input_ids"] + case["output_ids"][:cut]

    async def body():
        stream = await engine.async_generate(
            input_ids=case["input_ids"],
            stream=True,
            sampling_params={"temperature": 0, "max_new_tokens": 60, "ignore_eos": True},
        )
        first = await stream.__anext__()
        # the long prompt arrives while the stream decodes: its chunks and the stream's
        # decode steps take turns (the plans are asserted in test_scheduler_chunked)
        long_out = asyncio.ensure_future(
            engine.async_generate(
                input_ids=long_prompt, sampling_params={"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
            )
        )
        chunks = [first] + [c async for c in stream]
        return chunks, await long_out

    chunks, long_out = asyncio.run(body())
    assert chunks[-1]["output_ids"] == case["output_ids"][:60]
    assert long_out["output_ids"] == case["output_ids"][cut : cut + 1]


def test_default_chunk_size_on_cpu_and_off(stories_path):
    from pyserve.config import ServerArgs

    assert ServerArgs(model_path="m").resolved_chunked_prefill_size(None) == 8192
    assert ServerArgs(model_path="m", chunked_prefill_size=-1).resolved_chunked_prefill_size(None) is None
    assert ServerArgs(model_path="m").resolved_chunked_prefill_size(80 << 30) == 8192
    assert ServerArgs(model_path="m").resolved_chunked_prefill_size(24 << 30) == 2048
    assert ServerArgs(model_path="m").resolved_chunked_prefill_size(141 << 30) == 8192
    assert ServerArgs(model_path="m").resolved_chunked_prefill_size(192 << 30) == 16384
    eng = Engine(model_path=str(stories_path), max_total_tokens=POOL, chunked_prefill_size=-1)
    try:
        assert eng.core.scheduler.chunked_prefill_size is None
    finally:
        eng.shutdown()
