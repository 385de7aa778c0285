"""Scheduling policies and in-batch prefix sharing: exact queue orders for fcfs, lof, random
(seeded), lpm (with its fcfs fallback above 128 waiting and its in-batch twins last) and
dfs-weight, and, through the scheduler with the fake worker, a twin that waits one round and
then reuses the prompt its twin computes."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from pyserve.engine.schedule_batch import Req
from pyserve.engine.schedule_policy import LPM_MAX_WAITING, SchedulePolicy
from pyserve.mem_cache.kv_cache import KVCache
from pyserve.sampling_params import SamplingParams

from .test_scheduler import Harness, run, settle, treq


def req(rid: str, ids: list[int], max_new_tokens: int = 4) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), max_new_tokens, frozenset())


def cache_prompt(kv: KVCache, ids: list[int]) -> None:
    a = kv.admit(ids)
    assert a is not None and kv.prepare_extend([a.req_id], [len(ids) - a.prefix_len]) is not None
    kv.cache_finished_req(a.req_id, ids)


def order(policy: str, kv: KVCache, reqs: list[Req], seed: int | None = None) -> list[str]:
    waiting = deque(reqs)
    SchedulePolicy(policy, kv, seed=seed).order(waiting)
    return [r.rid for r in waiting]


@pytest.fixture
def kv() -> KVCache:
    return KVCache(4096, max_running_requests=8, max_context_len=512)


def test_fcfs_lof_and_random(kv):
    reqs = [req("a", [1], 3), req("b", [2], 10), req("c", [3], 5), req("d", [4], 10)]
    assert order("fcfs", kv, reqs) == ["a", "b", "c", "d"]
    assert order("lof", kv, reqs) == ["b", "d", "c", "a"]  # ties keep arrival order
    expected = list(reqs)
    random.Random(7).shuffle(expected)
    assert order("random", kv, reqs, seed=7) == [r.rid for r in expected]
    with pytest.raises(ValueError, match="schedule policy 'lifo'"):
        SchedulePolicy("lifo", kv)


def test_lpm_longest_cached_prefix_first(kv):
    base = list(range(100, 160))  # 60 tokens
    cache_prompt(kv, base)
    reqs = [
        req("none", [7, 8, 9]),
        req("half", base[:30] + [1, 2]),
        req("all", base + [5]),
        req("ten", base[:10] + [3]),
    ]
    assert order("lpm", kv, reqs) == ["all", "half", "ten", "none"]
    # matching for the order changed nothing in the cache
    assert kv.match_lens([r.prefix_key() for r in reqs]).tolist() == [0, 30, 60, 10]
    many = [req(f"r{k}", [7, k]) for k in range(LPM_MAX_WAITING)] + [req("all", base + [5])]
    assert order("lpm", kv, many)[-1] == "all"  # more than 128 waiting: fcfs


def test_lpm_puts_in_batch_twins_last(kv):
    shared = list(range(300, 340))  # 40 uncached tokens
    reqs = [
        req("first", shared + [1]),
        req("twin", shared + [2]),
        req("other", [9, 9, 9]),
        req("short-twin", shared[:20] + [3]),
    ]
    # twin shares 32+ uncached tokens with first: it goes last; a 20-token overlap is not enough
    assert order("lpm", kv, reqs) == ["first", "other", "short-twin", "twin"]


def test_dfs_weight_groups_by_branch(kv):
    a, b = list(range(10, 20)), list(range(50, 56))
    cache_prompt(kv, a)
    cache_prompt(kv, b)
    reqs = [
        req("b1", b + [1]),
        req("root", [999]),
        req("a1", a + [1]),
        req("a2", a + [2]),
        req("b2", b + [2]),
        req("a3", a + [3]),
    ]
    assert order("dfs-weight", kv, reqs) == ["root", "a1", "a2", "a3", "b1", "b2"]


def test_a_twin_waits_one_round_then_reuses_the_prompt():
    async def body():
        h = Harness()
        shared = list(range(1, 41))  # 40 tokens, none cached
        h.sched.add_request(treq("first", shared + [50], max_new_tokens=2))
        h.sched.add_request(treq("twin", shared + [60], max_new_tokens=2))
        h.sched.add_request(treq("other", [70, 71], max_new_tokens=2))
        await h.start()
        plans = h.worker.plans
        # round 1: first and other (the twin waits without holding up other)
        assert plans[0].seq_lens.tolist() == [41, 2] and plans[0].prefix_lens.tolist() == [0, 0]
        # first's prompt entered the cache when its step was planned: the twin reuses all 40
        # shared tokens (computed by step 1, which runs before the twin's)
        twin = plans[1]
        assert twin.forward_mode.name == "EXTEND" and twin.prefix_lens.tolist() == [40]
        assert twin.extend_lens.tolist() == [1] and twin.input_ids.tolist() == [60]
        assert twin.row_slots.tolist()[:40] == plans[0].row_slots.tolist()[:40]
        token = 100
        while h.worker.pending:  # run every step to the end, whatever the batches
            size = h.worker.pending[0][0].batch_size
            await h.step(list(range(token, token + size)))
            token += size
        assert [o.cached_tokens for o in h.outs_of("twin")][:1] == [40]
        await settle()
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_admission_turns_away_what_cannot_fit_without_locking(kv):
    """A request whose prefix is cached but unlocked: admitting it would lock that prefix
    and take it out of the evictable pool; when the rest cannot fit then, it is turned away
    before anything is locked (no match-lock-abort churn)."""
    from pyserve.engine.schedule_policy import PrefillAdder

    small = KVCache(64, max_running_requests=4, max_context_len=64)
    cache_prompt(small, list(range(1, 41)))  # 40 cached, unlocked tokens
    assert small.match_unlocked(np.asarray(list(range(1, 41)), dtype=np.int32)) == (40, 40)
    big = req("big", list(range(1, 41)) + list(range(100, 120)), max_new_tokens=10)
    calls: list[str] = []
    admit = small.admit

    def counting_admit(key):  # type: ignore[no-untyped-def]
        calls.append("admit")
        return admit(key)

    small.admit = counting_admit  # type: ignore[method-assign]
    adder = PrefillAdder(small, [], 4, 8192)
    # 20 new tokens + 10 reserved fit the 24 free slots only if the 40 cached tokens could be
    # evicted, but this request would lock them: 64 - 40 = 24 < 30
    assert adder.admit_from(deque([big])) == [] and calls == []
    assert small.num_reqs() == 0 and small.protected_slots() == 0
    fits = req("fits", list(range(1, 41)) + [7, 8, 9], max_new_tokens=10)
    assert adder.admit_from(deque([fits])) == [fits] and calls == ["admit"]
    assert small.protected_slots() == 40
