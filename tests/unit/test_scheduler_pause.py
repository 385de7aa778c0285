"""Pausing a request whose streaming client is behind (Scheduler.pause_request): no decode step
takes it after the steps already in flight, it keeps its KV and row, it resumes where it
stopped with the same tokens, an empty pipeline wakes up on resume, a paused request can be
aborted, and it is the first one retracted when the pool is full (and waits, unadmitted,
until its client catches up)."""

from __future__ import annotations

from pyserve.forward_batch_info import EndCause, FinishKind, FinishReason
from tests.unit.test_scheduler import Harness, run, settle, treq


def rows_of(h: Harness, plans) -> list[list[int]]:
    return [p.req_pool_indices.tolist() for p in plans]


def test_a_paused_request_skips_decode_steps_and_resumes_with_its_kv():
    async def body():
        h = Harness()
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=5))
        h.sched.add_request(treq("b", [4, 5], max_new_tokens=5))
        await h.start()
        await h.step([10, 20])  # the prefill; decode 1 runs, decode 2 is planned
        row_a, row_b = h.sched.reqs["a"].admission.req_pool_idx, h.sched.reqs["b"].admission.req_pool_idx
        h.sched.pause_request("a", True)
        planned = len(h.worker.plans)
        await h.step([11, 21])  # decode 1 (a was in it)
        await h.step([12, 22])  # decode 2 (planned before the pause: a too)
        kv_len_a = h.kv.kv_len(h.sched.reqs["a"].admission.req_id)
        await h.step([23])  # b alone from here
        await h.step([24])
        assert rows_of(h, h.worker.plans[planned:]) == [[row_b], [row_b]]
        assert [o.ids_delta for o in h.outs_of("b")] == [[20], [21], [22], [23], [24]]
        assert h.outs_of("b")[-1].finish_reason.kind is FinishKind.LENGTH
        assert [o.ids_delta for o in h.outs_of("a")] == [[10], [11], [12]]
        assert not h.worker.pending and h.sched.num_paused() == 1
        assert h.kv.kv_len(h.sched.reqs["a"].admission.req_id) == kv_len_a  # its KV is kept
        h.sched.pause_request("a", False)
        await settle()
        await h.step([13])  # its decode resumes after its last token (12)
        await h.step([14])
        assert h.worker.inputs[-2:] == [[12], [13]]
        assert rows_of(h, h.worker.plans[-2:]) == [[row_a], [row_a]]
        assert [o.ids_delta for o in h.outs_of("a")] == [[10], [11], [12], [13], [14]]
        assert h.outs_of("a")[-1].finish_reason.kind is FinishKind.LENGTH
        await settle()
        h.assert_no_leak()
        await h.stop()

    run(body())


async def drain(h: Harness, token: int) -> None:
    """Run the steps the scheduler plans (each request gets `token`) until it plans none."""
    while h.worker.pending:
        await h.step([token] * len(h.worker.pending[0][0].req_pool_indices))


def test_a_paused_request_can_be_aborted_and_frees_its_kv():
    async def body():
        h = Harness()
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=8))
        await h.start()
        await h.step([10])
        h.sched.pause_request("a", True)
        await h.step([11])
        await h.step([12])  # the two decode steps planned before the pause
        assert not h.worker.pending
        h.sched.end("a", FinishReason.abort(EndCause.CLIENT_GONE, "client gone"))
        await settle()
        assert h.outs_of("a")[-1].finish_reason.is_abort
        h.sched.pause_request("a", False)  # (the writer's resume after the end: ignored)
        await settle()
        assert not h.worker.pending
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_the_paused_request_is_retracted_first_and_waits_for_its_client():
    async def body():
        h = Harness()
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=6))
        h.sched.add_request(treq("b", [4, 5], max_new_tokens=6))
        await h.start()
        await h.step([10, 20])  # decode 1 runs; decode 2 was planned
        h.sched.pause_request("b", True)
        real = h.kv.prepare_decode
        calls: list[list[int]] = []

        def full_twice(req_ids):  # the pool is "full" for the next two decode plans
            calls.append([int(r) for r in req_ids])
            return None if len(calls) <= 2 else real(req_ids)

        h.kv.prepare_decode = full_twice
        a_id = h.sched.reqs["a"].admission.req_id
        await h.step([11, 21])  # planning decode 3 (a alone) finds the pool full: drain
        await h.step([12, 22])  # full again, nothing in flight: retract. By SGLang's rule it
        # would be a (as many outputs as b, the longer prompt); b is paused, so b goes
        b = h.sched.reqs["b"]
        assert h.sched.retractor.num_retracted == 1 and b.admission is None and b.num_retractions == 1
        assert calls == [[a_id]] * 4  # two full, then decode 3 and 4 (overlap) of a alone
        await drain(h, 30)
        assert sum(len(o.ids_delta) for o in h.outs_of("a")) == 6
        assert h.outs_of("a")[-1].finish_reason.kind is FinishKind.LENGTH
        assert list(h.sched.waiting) == [b] and b.admission is None  # not admitted while paused
        h.sched.pause_request("b", False)
        await settle()
        resume = h.worker.pending[0][0]
        assert resume.forward_mode.name == "EXTEND" and resume.extend_lens.tolist() == [1]
        await drain(h, 40)
        assert [o.ids_delta for o in h.outs_of("b")] == [[20], [21], [22], [40], [40], [40]]
        h.assert_no_leak()
        await h.stop()

    run(body())
