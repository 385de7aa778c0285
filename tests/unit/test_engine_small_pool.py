"""A KV pool smaller than the context: requests that can never fit are refused (an explicit
max_new_tokens) or clipped to what the pool holds (none), never
wait forever, and requests that do not fit together take turns (retraction) with exact
outputs."""

from __future__ import annotations

import pytest

from tests.conftest import make_stories_engine, wait_engine_idle

POOL = 300


@pytest.fixture(scope="module")
def engine(stories_path):
    eng = make_stories_engine(stories_path, POOL)
    yield eng
    eng.shutdown()


def test_request_that_can_never_fit_the_pool_is_refused_or_clipped(engine):
    """An explicit max_new_tokens beyond the pool is refused before it is queued (400, it
    could never run); with none the request fills what the pool holds and finishes."""
    from pyserve import InvalidRequestError

    prompt = "Once upon a time"
    with pytest.raises(InvalidRequestError) as exc:
        engine.generate(prompt, {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True})
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "max_new_tokens"
    assert f"but the KV pool holds {POOL}: it could never run" in str(exc.value)
    none = engine.generate(prompt, {"temperature": 0, "max_new_tokens": None, "ignore_eos": True})
    prompt_len = none["meta_info"]["prompt_tokens"]
    assert none["meta_info"]["completion_tokens"] == POOL - prompt_len
    assert none["meta_info"]["finish_reason"] == {"type": "length", "length": POOL - prompt_len}


def test_requests_that_do_not_fit_together_all_finish_exactly(engine, stories_reference):
    # 5 x (prompt + 64) tokens > 300 slots: some wait or are retracted, outputs stay exact.
    cases = stories_reference[1:] * 2
    outs = engine.generate(
        input_ids=[c["input_ids"] for c in cases],
        sampling_params=[{"temperature": 0, "max_new_tokens": 64, "ignore_eos": True} for _ in cases],
    )
    for case, out in zip(cases, outs):
        assert out["output_ids"] == case["output_ids"]
    info = wait_engine_idle(engine)
    assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL


def test_retraction_when_reservations_overcommit(engine, stories_reference, monkeypatch):
    from pyserve.engine import schedule_policy

    monkeypatch.setattr(schedule_policy, "CLIP_MAX_NEW_TOKENS", 4)  # admit far more than fits
    cases = stories_reference[1:] * 2
    retracted = engine.core.scheduler.retractor.num_retracted
    outs = engine.generate(
        input_ids=[c["input_ids"] for c in cases],
        sampling_params=[{"temperature": 0, "max_new_tokens": 64, "ignore_eos": True} for _ in cases],
    )
    assert engine.core.scheduler.retractor.num_retracted > retracted
    for case, out in zip(cases, outs):
        assert out["output_ids"] == case["output_ids"]
        assert out["meta_info"]["prompt_tokens"] == len(case["input_ids"])
    info = wait_engine_idle(engine)
    assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL


def test_32_requests_through_a_pool_for_8(stories_path, stories_reference):
    """A pool that holds 8 of 32 concurrent requests (prompt + 64 tokens each) and rows for
    all 32: admission (new-token ratio 0.7) over-commits, decode retracts, the retracted
    resume from their cached tokens; every output equals the reference (HF's greedy ids, what
    an unconstrained run gives), nothing fails, nothing leaks."""
    cases = stories_reference[1:] * 8  # 32 requests of 5-13 prompt tokens + 64 new
    pool = 8 * max(len(c["input_ids"]) + 64 for c in cases)
    eng = make_stories_engine(stories_path, pool, max_running_requests=32)
    try:
        outs = eng.generate(
            input_ids=[c["input_ids"] for c in cases],
            sampling_params=[{"temperature": 0, "max_new_tokens": 64, "ignore_eos": True} for _ in cases],
        )
        assert [o["output_ids"] for o in outs] == [c["output_ids"] for c in cases]
        assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 64} for o in outs)
        info = wait_engine_idle(eng)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == pool
        assert eng.core.scheduler.num_steps > 64  # they took turns
    finally:
        eng.shutdown()


def test_retracted_grammar_requests_resume_their_grammar(engine, stories_path, stories_reference, monkeypatch):
    """Grammar requests retracted mid-output resume with their matcher replaying the output
    so far: the same ids as on a pool where nothing is retracted, and nothing leaks."""
    from pyserve.engine import schedule_policy

    cases = stories_reference[1:] * 2
    params = [{"temperature": 0, "max_new_tokens": 64, "regex": "[a-z ]{40}[0-9]{20}"} for _ in cases]
    roomy = make_stories_engine(stories_path, 4096)
    try:
        want = roomy.generate(input_ids=[c["input_ids"] for c in cases], sampling_params=params)
    finally:
        roomy.shutdown()
    monkeypatch.setattr(schedule_policy, "CLIP_MAX_NEW_TOKENS", 4)  # admit far more than fits
    retracted = engine.core.scheduler.retractor.num_retracted
    outs = engine.generate(input_ids=[c["input_ids"] for c in cases], sampling_params=params)
    assert engine.core.scheduler.retractor.num_retracted > retracted
    assert [o["output_ids"] for o in outs] == [w["output_ids"] for w in want]
    assert all(len(o["text"]) == 60 and o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
    info = wait_engine_idle(engine)
    assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL


def test_the_stats_line_sums_up_retractions_and_shows_cached_tokens_apart(
    stories_path, stories_reference, monkeypatch, caplog
):
    """Retractions are one WARNING line per stats interval with their count (none per
    request); the stats line shows the KV held by requests and the evictable cache apart."""
    from pyserve.engine import schedule_policy

    eng = make_stories_engine(stories_path, POOL, stats_interval_s=0.05)
    try:
        monkeypatch.setattr(schedule_policy, "CLIP_MAX_NEW_TOKENS", 4)  # admit far more than fits
        cases = stories_reference[1:] * 2
        with caplog.at_level("DEBUG", logger="pyserve.engine"):
            eng.generate(
                input_ids=[c["input_ids"] for c in cases],
                sampling_params=[{"temperature": 0, "max_new_tokens": 64, "ignore_eos": True} for _ in cases],
            )
        retracted = eng.core.scheduler.retractor.num_retracted
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        summed = [int(m.split(": ")[1].split()[0]) for m in warnings if "retractions in the last" in m]
        assert retracted > 0 and warnings and len(summed) == len(warnings)
        assert sum(summed) <= retracted  # (the last interval's are logged when it ends)
        stats = [r.getMessage() for r in caplog.records if r.getMessage().startswith("running=")]
        assert stats and all(f"/{POOL} (" in m and " kv_cached=" in m for m in stats)
        info = wait_engine_idle(eng)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL
    finally:
        eng.shutdown()
