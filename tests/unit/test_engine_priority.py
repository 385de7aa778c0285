"""Priority scheduling through the Engine on stories260k: with one running slot, waiting
requests run most urgent first; the greedy outputs are unchanged; a priority given while
priority scheduling is off is ignored, or refused with --abort-on-priority-when-disabled."""

from __future__ import annotations

import asyncio

import pytest

from pyserve import InvalidRequestError
from tests.conftest import make_stories_engine


def test_waiting_requests_run_most_urgent_first(stories_path, stories_reference):
    eng = make_stories_engine(stories_path, 2048, max_running_requests=1, enable_priority_scheduling=True)
    case = stories_reference[1]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    try:
        async def body() -> list[str]:
            done: list[str] = []

            async def one(rid: str, priority: int, max_new: int = 12) -> dict:
                out = await eng.async_generate(input_ids=case["input_ids"], rid=rid, priority=priority,
                                               sampling_params=dict(params, max_new_tokens=max_new))
                done.append(rid)
                return out

            first = asyncio.ensure_future(one("busy", 0, 60))  # holds the one slot
            await asyncio.sleep(0.2)
            outs = await asyncio.gather(one("p1", 1), one("p9", 9), one("p5", 5), first)
            assert all(o["output_ids"] == case["output_ids"][:len(o["output_ids"])] for o in outs)
            return done

        assert asyncio.run(body()) == ["busy", "p9", "p5", "p1"]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("abort", [False, True])
def test_a_priority_while_disabled(stories_path, abort):
    eng = make_stories_engine(stories_path, 2048, abort_on_priority_when_disabled=abort)
    try:
        if abort:
            with pytest.raises(InvalidRequestError, match="priority scheduling is not enabled"):
                eng.generate(input_ids=[1, 403], priority=3, sampling_params={"max_new_tokens": 2})
        else:
            out = eng.generate(input_ids=[1, 403], priority=3, sampling_params={"max_new_tokens": 2})
            assert out["meta_info"]["completion_tokens"] == 2
    finally:
        eng.shutdown()
