"""Priority scheduling through the Engine on stories260k: with one running slot, waiting
requests run most urgent first; the greedy outputs are unchanged; a priority given while
priority scheduling is off is ignored, or refused with --abort-on-priority-when-disabled."""

from __future__ import annotations

import asyncio

import pytest

from pyserve import InvalidRequestError
from tests.conftest import make_stories_engine

# The request that holds the one running slot: the reference's longest case (its prompt is
# the BOS token alone), run far past its 200 reference tokens so that it is still running
# when the later requests come, however fast the machine (a 60-token one finished within the
# tests' old fixed sleeps on a fast machine); its output is checked against the reference's
# 200 tokens (greedy: a prefix).
BUSY_NEW_TOKENS = 480


async def _busy(eng, busy_case: dict, priority: int) -> dict:
    """The long greedy request that holds the one running slot (see BUSY_NEW_TOKENS)."""
    return await eng.async_generate(
        input_ids=busy_case["input_ids"],
        rid="busy",
        priority=priority,
        sampling_params={"temperature": 0, "max_new_tokens": BUSY_NEW_TOKENS, "ignore_eos": True},
    )


async def _until(eng, what: str, pred) -> None:
    """Poll eng.get_server_info() (on the engine's loop thread) until pred(info) holds."""
    deadline = asyncio.get_running_loop().time() + 30
    while not pred(info := eng.get_server_info()):
        assert asyncio.get_running_loop().time() < deadline, (what, info)
        await asyncio.sleep(0.002)


def test_waiting_requests_run_most_urgent_first(stories_path, stories_reference):
    eng = make_stories_engine(stories_path, 2048, max_running_requests=1, enable_priority_scheduling=True)
    case = stories_reference[1]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    try:

        async def body() -> list[str]:
            done: list[str] = []

            async def one(rid: str, priority: int, max_new: int = 12) -> dict:
                out = await eng.async_generate(
                    input_ids=case["input_ids"],
                    rid=rid,
                    priority=priority,
                    sampling_params=dict(params, max_new_tokens=max_new),
                )
                done.append(rid)
                return out

            busy_case = stories_reference[0]

            async def busy() -> dict:
                out = await _busy(eng, busy_case, 0)
                done.append("busy")
                return out

            first = asyncio.ensure_future(busy())  # holds the one slot
            await _until(eng, "busy running", lambda i: i["num_running_reqs"] == 1)
            outs = await asyncio.gather(one("p1", 1), one("p9", 9), one("p5", 5), first)
            assert outs[3]["output_ids"][:200] == busy_case["output_ids"]
            assert all(o["output_ids"] == case["output_ids"][:12] for o in outs[:3])
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


def test_a_full_queue_lets_the_least_urgent_go_for_a_more_urgent_one(stories_path, stories_reference):
    from pyserve import QueueFullError

    eng = make_stories_engine(
        stories_path, 2048, max_running_requests=1, max_queued_requests=1, enable_priority_scheduling=True
    )
    case = stories_reference[1]
    try:

        async def body():
            async def one(rid, priority, max_new=12):
                return await eng.async_generate(
                    input_ids=case["input_ids"],
                    rid=rid,
                    priority=priority,
                    sampling_params={"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True},
                )

            busy = asyncio.ensure_future(_busy(eng, stories_reference[0], 5))  # runs
            await _until(eng, "busy running", lambda i: i["num_running_reqs"] == 1)
            low = asyncio.ensure_future(one("low", 1))  # waits: the queue is full now
            await _until(eng, "low waiting", lambda i: i["num_waiting_reqs"] == 1)
            with pytest.raises(QueueFullError):
                await one("lower", 0)  # not more urgent than low: refused
            high = await one("high", 9)  # more urgent: low is let go, high runs
            with pytest.raises(QueueFullError, match="for a more urgent one"):
                await low
            return await busy, high

        busy, high = asyncio.run(body())
        assert busy["output_ids"][:200] == stories_reference[0]["output_ids"]
        assert len(busy["output_ids"]) == BUSY_NEW_TOKENS and high["output_ids"] == case["output_ids"][:12]
    finally:
        eng.shutdown()


def test_priority_settings_are_checked():
    from pyserve.config import ServerArgs, ServerArgsError

    with pytest.raises(ServerArgsError, match="priority scheduling needs fcfs or lof"):
        ServerArgs(model_path="m", enable_priority_scheduling=True, schedule_policy="lpm")
    with pytest.raises(ServerArgsError, match="must be >= 0"):
        ServerArgs(model_path="m", priority_scheduling_preemption_threshold=-1)
    assert ServerArgs(model_path="m", enable_priority_scheduling=True, schedule_policy="lof").schedule_policy == "lof"
