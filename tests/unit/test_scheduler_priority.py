"""Priority scheduling against the fake worker: the waiting queue runs most urgent first
(higher values, or lower with low-values-first), a request at least the threshold more urgent
preempts the least urgent running request (the newest of equals), the preempted one resumes
from its cached tokens and finishes in full, and nothing leaks."""

from __future__ import annotations

import asyncio
import dataclasses

from .test_scheduler import Harness, settle, treq


def prio(rid: str, ids: list[int], priority: int, max_new_tokens: int = 3):
    return dataclasses.replace(treq(rid, ids, max_new_tokens=max_new_tokens), priority=priority)


class PriorityHarness(Harness):
    """Records each EXTEND batch's rids (with their extend lengths) and each retraction."""

    def __init__(self, low_first: bool = False) -> None:
        super().__init__()
        retractor = self.sched.retractor
        retractor.enable_priority_scheduling = True
        retractor.low_priority_values_first = low_first
        retractor.preemption_threshold = 10
        self.extends: list[list[tuple[str, int]]] = []
        self.retracted: list[str] = []
        pipeline = self.sched.pipeline
        launch, send_back = pipeline.launch, retractor.send_back

        def recording_launch(batch):
            if batch.forward_mode.name == "EXTEND":
                self.extends.append(list(zip([r.rid for r in batch.reqs], batch.plan.extend_lens.tolist())))
            launch(batch)

        def recording_send_back(req):
            self.retracted.append(req.rid)
            send_back(req)

        pipeline.launch, retractor.send_back = recording_launch, recording_send_back

    async def drain(self) -> None:
        token = 100
        while self.worker.pending:
            size = self.worker.pending[0][0].batch_size
            await self.step(list(range(token, token + size)))
            token += size


def admission_order(low_first: bool) -> list[list[str]]:
    async def body() -> list[list[str]]:
        h = PriorityHarness(low_first=low_first)
        for k in range(4):  # fill the 4 rows
            h.sched.add_request(prio(f"run{k}", [1, 2, 3 + k], 0))
        await h.start()
        for rid, p in (("p1", 1), ("p5", 5), ("p3", 3)):  # within the threshold: no preemption
            h.sched.add_request(prio(rid, [7, 8, 9], p))
        await h.drain()
        await settle()
        assert h.retracted == []
        h.assert_no_leak()
        await h.stop()
        return [[rid for rid, _ in batch] for batch in h.extends]

    return asyncio.run(body())


def test_most_urgent_first_either_way():
    assert admission_order(low_first=False) == [["run0", "run1", "run2", "run3"], ["p5", "p3", "p1"]]
    assert admission_order(low_first=True) == [["run0", "run1", "run2", "run3"], ["p1", "p3", "p5"]]


def test_an_urgent_request_preempts_the_least_urgent_newest_running_one():
    async def body():
        h = PriorityHarness()
        for k, p in enumerate((0, 0, 3, 0)):
            h.sched.add_request(prio(f"run{k}", [1, 2, 3 + k], p, max_new_tokens=8))
        await h.start()
        await h.step([10, 11, 12, 13])
        h.sched.add_request(prio("urgent", [7, 8, 9], 20, max_new_tokens=2))
        h.sched.add_request(prio("mild", [7, 8, 6], 5, max_new_tokens=2))  # 5 < 0 + 10: waits
        await h.drain()
        # run3 (priority 0, the newest of the least urgent) made room; run2 (priority 3) stayed
        assert h.retracted == ["run3"]
        assert h.extends[1] == [("urgent", 3)]
        # run3 resumed from its cached tokens (prompt + outputs so far): one token re-prefilled
        # priority order at the start (run2 first); mild (sharing urgent's cached [7, 8]) and
        # then run3 join as rows free up; run3 re-prefills one token: the rest was cached
        assert h.extends == [
            [("run2", 3), ("run0", 3), ("run1", 3), ("run3", 3)],
            [("urgent", 3)],
            [("mild", 1)],
            [("run3", 1)],
        ]
        outs = {
            rid: [t for o in h.outs_of(rid) for t in o.ids_delta]
            for rid in ("run0", "run1", "run2", "run3", "urgent", "mild")
        }
        assert [len(outs[f"run{k}"]) for k in range(4)] == [8, 8, 8, 8]
        assert len(outs["urgent"]) == 2 and len(outs["mild"]) == 2
        await settle()
        h.assert_no_leak()
        await h.stop()

    asyncio.run(body())


def test_a_request_without_priority_is_the_least_urgent():
    h = PriorityHarness()
    assert h.sched.priority_of(None) == -(2**63) and h.sched.priority_of(3) == 3
    h.sched.retractor.low_priority_values_first = True
    assert h.sched.priority_of(None) == 2**63 - 1
    h.sched.retractor.enable_priority_scheduling = False
    assert h.sched.priority_of(7) == 0  # off: every request is equal
