"""The scheduler against a fake worker: exact plans, overlap (step N+1 planned before step N's
results), one-step-late finishes released exactly once, aborts mid-flight, decode inputs read
from the worker's device token table, and no KV, row or sampling-row leak."""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np
import pytest

from pyserve.engine.scheduler import Scheduler
from pyserve.engine.scheduler_config import SchedulerConfig
from pyserve.forward_batch_info import EndCause, FinishKind, FinishReason, ForwardMode, StepOutput
from pyserve.io_struct import TokenizedGenerateReq
from pyserve.mem_cache.kv_cache import KVCache
from pyserve.model_executor.device_state import DeviceState
from pyserve.sampling_params import SamplingParams

ABORT = FinishReason.abort(EndCause.ABORTED, "test")
POOL = 100
VOCAB = 128


class FakeWorker:
    """Queues plans as the real worker does; a test runs them one at a time (`run_next`) with
    the token ids it chooses. Each run builds the step's ForwardBatch from the real
    DeviceState (so decode inputs come from its token table) and records its input ids."""

    def __init__(self, kv: KVCache) -> None:
        self.state = DeviceState(kv.num_rows, kv.max_context_len, VOCAB, "cpu")
        self.pending: deque = deque()
        self.plans: list = []
        self.inputs: list[list[int]] = []

    @property
    def num_live_sampling_rows(self) -> int:
        return self.state.sampling.num_live

    def submit(self, plan, done=None):
        future = asyncio.get_running_loop().create_future()
        self.plans.append(plan)
        self.pending.append((plan, future, done))
        return future

    def release_rows(self, rows) -> None:
        self.state.sampling.release_rows(rows)

    @staticmethod
    def _resolve(future, done, result=None, exc=None) -> None:
        """As the worker's resolve callback: the future, then the scheduler's done hook, on
        the loop after the caller returns (the worker calls it thread-safely)."""

        def resolve() -> None:
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)
            if done is not None:
                done(future)

        asyncio.get_running_loop().call_soon(resolve)

    def fail_next(self, exc: Exception) -> None:
        _, future, done = self.pending.popleft()
        self._resolve(future, done, exc=exc)

    def run_next(self, ids: list[int]) -> None:
        import torch

        plan, future, done = self.pending.popleft()
        batch = self.state.forward_batch(plan)
        self.inputs.append(batch.input_ids.tolist())
        next_ids = torch.tensor(ids, dtype=torch.int64)
        self.state.record_sampled(plan, batch, next_ids)
        self._resolve(future, done, StepOutput(next_token_ids=np.array(ids, dtype=np.int32)))


def treq(rid: str, ids: list[int], max_new_tokens: int = 5, stop=frozenset()) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(
        rid, ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), frozenset(stop)
    )


class Harness:
    def __init__(self, overlap: bool = True, pool: int = POOL) -> None:
        self.outs: list = []
        self.kv = KVCache(pool, max_running_requests=4, max_context_len=64)
        self.worker = FakeWorker(self.kv)
        self.sched = Scheduler(
            SchedulerConfig(context_len=64, max_running_requests=4, max_prefill_tokens=64, overlap=overlap),
            self.kv,
            self.worker,
            emit=self.outs.extend,
        )

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self.sched.run())
        await settle()

    async def step(self, ids: list[int]) -> None:
        """Let the worker finish its oldest step with `ids`, then let the loop react."""
        self.worker.run_next(ids)
        await settle()

    async def stop(self) -> None:
        await self.sched.stop()
        await settle()
        self.task.cancel()

    def outs_of(self, rid: str) -> list:
        return [o for o in self.outs if o.rid == rid]

    def assert_no_leak(self) -> None:
        self.kv.core.check_integrity()
        assert self.kv.num_reqs() == 0 and self.kv.protected_slots() == 0
        assert self.kv.free_slots() + self.kv.evictable_slots() == POOL
        assert self.worker.num_live_sampling_rows == 0
        assert self.sched.is_idle() and self.sched.reqs == {}


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def run(coro) -> None:
    asyncio.run(coro)


def test_exact_plans_and_decode_inputs_from_the_token_table():
    async def body():
        h = Harness()
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=3))
        h.sched.add_request(treq("b", [4, 5], max_new_tokens=3))
        await h.start()
        # overlap: the extend and the first decode are both planned before any result
        assert [p.forward_mode for p in h.worker.plans] == [ForwardMode.EXTEND, ForwardMode.DECODE]
        ext, dec = h.worker.plans
        rows = ext.req_pool_indices.tolist()
        assert ext.input_ids.tolist() == [1, 2, 3, 4, 5] and ext.input_ids.dtype == np.int32
        assert ext.positions.tolist() == [0, 1, 2, 0, 1] and ext.out_cache_loc.tolist() == [1, 2, 3, 4, 5]
        assert ext.seq_lens.tolist() == [3, 2] and ext.row_slots.tolist() == [1, 2, 3, 4, 5]
        assert [r.req_pool_idx for r in ext.new_sampling_rows] == rows and ext.all_greedy
        # decode: O(batch) integers, no input ids (they are on the worker), no rows copied
        assert dec.input_ids is None and dec.row_slots is None
        assert dec.req_pool_indices.tolist() == rows
        assert dec.positions.tolist() == [3, 2] and dec.out_cache_loc.tolist() == [6, 7]
        assert dec.seq_lens.tolist() == [4, 3] and dec.new_sampling_rows == []
        await h.step([10, 20])  # the extend's tokens
        assert [(o.rid, o.ids_delta) for o in h.outs] == [("a", [10]), ("b", [20])]
        assert len(h.worker.plans) == 3  # the next decode was planned while step 1 runs
        assert h.worker.plans[2].positions.tolist() == [4, 3]
        assert h.worker.plans[2].out_cache_loc.tolist() == [8, 9]
        await h.step([11, 21])
        # the decode's inputs were the extend's sampled tokens, read from the token table
        assert h.worker.inputs == [[1, 2, 3, 4, 5], [10, 20]]
        await h.step([12, 22])
        assert h.worker.inputs[2] == [11, 21]
        # max_new_tokens 3 is known ahead: no fourth step was planned
        assert len(h.worker.plans) == 3 and not h.worker.pending
        assert [o.ids_delta for o in h.outs_of("a")] == [[10], [11], [12]]
        assert h.outs_of("a")[-1].finish_reason == FinishReason.length_limit(3)
        await settle()
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_a_step_result_launches_the_next_step_in_its_own_callback():
    """The callback that resolves step N processes it and submits the next step before any
    other ready callback runs (the device is not kept waiting behind the loop's HTTP work)."""

    async def body():
        h = Harness()
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=4))
        await h.start()
        assert len(h.worker.plans) == 2  # the extend, and the decode planned behind it
        seen = []
        h.worker.run_next([10])  # resolves on the loop's next iteration
        asyncio.get_running_loop().call_soon(lambda: seen.append(len(h.worker.plans)))
        await settle()
        assert seen == [3]  # already submitted when the callback queued behind it ran
        assert h.worker.plans[2].positions.tolist() == [4]
        while h.worker.pending:
            await h.step([11])
        await settle()
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_the_decode_behind_a_prefill_is_planned_at_once_as_a_third_step():
    """With overlap, once a prefill is the newer of two steps in flight, the decode step
    after it is planned at once (it holds no request that is in two unprocessed steps), not
    when the older step is processed. A request that stops meanwhile is still only one step
    late: one token dropped, released once."""

    async def body():
        h = Harness()
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=10, stop={99}))
        await h.start()
        await h.step([10])  # a's prefill: its decodes 1 and 2 are in flight
        a_row = h.worker.plans[0].req_pool_indices.tolist()
        h.sched.add_request(treq("b", [4, 5], max_new_tokens=3))
        await settle()
        assert len(h.worker.pending) == 2  # b waits for the next step boundary, as in SGLang
        await h.step([11])  # decode 1: b's prefill is planned, and right behind it decode 3
        assert [p.forward_mode for p in h.worker.plans] == [
            ForwardMode.EXTEND,
            ForwardMode.DECODE,
            ForwardMode.DECODE,
            ForwardMode.EXTEND,
            ForwardMode.DECODE,
        ]
        assert len(h.worker.pending) == 3
        pre, dec = h.worker.plans[3], h.worker.plans[4]
        b_row = pre.req_pool_indices.tolist()
        assert pre.input_ids.tolist() == [4, 5] and pre.positions.tolist() == [0, 1] and pre.num_decode_rows == 0
        assert [r.req_pool_idx for r in pre.new_sampling_rows] == b_row and b_row != a_row
        assert dec.req_pool_indices.tolist() == a_row + b_row and dec.positions.tolist() == [5, 2]
        assert dec.seq_lens.tolist() == [6, 3]
        await h.step([99])  # decode 2: a stops, but it is in decode 3 already
        assert h.outs_of("a")[-1].finish_reason == FinishReason.stop(99)
        assert len(h.worker.pending) == 2  # decode 3 is the newer step: no third step now
        await h.step([20])  # b's prefill: decode 4 is planned, b alone
        assert h.worker.plans[5].req_pool_indices.tolist() == b_row
        assert h.worker.plans[5].positions.tolist() == [3]
        assert h.kv.num_reqs() == 2  # a is still held: decode 3 writes its KV
        await h.step([7, 21])  # decode 3: a's extra token is dropped; a is released once
        assert h.kv.num_reqs() == 1
        assert [o.ids_delta for o in h.outs_of("a")] == [[10], [11], [99]]
        while h.worker.pending:
            await h.step([22])
        # decode inputs came from the token table, in the worker's order of steps
        assert h.worker.inputs == [[1, 2, 3], [10], [11], [4, 5], [99, 20], [21]]
        assert [o.ids_delta for o in h.outs_of("b")] == [[20], [21], [22]]
        assert h.outs_of("b")[-1].finish_reason == FinishReason.length_limit(3)
        await settle()
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_stats_are_refreshed_while_idle_after_a_burst():
    """Steps drive themselves, so the pipeline empties with the task asleep: it must still
    wake for the stats line (last_gen_throughput falls to 0 once nothing is generated)."""

    async def body():
        h = Harness()
        h.sched.stats_interval_s = 0.05
        await h.start()
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=3))
        await settle()
        while h.worker.pending:
            await asyncio.sleep(0.06)
            await h.step([10])
        assert h.sched.is_idle() and h.sched.last_gen_throughput > 0
        await asyncio.sleep(0.3)  # six stats intervals with nothing generated
        assert h.sched.last_gen_throughput == 0.0
        h.assert_no_leak()
        await h.stop()

    run(body())


@pytest.mark.parametrize("overlap", [True, False])
def test_stop_token_seen_one_step_late_releases_exactly_once(overlap):
    async def body():
        h = Harness(overlap=overlap)
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=10, stop={99}))
        await h.start()
        assert len(h.worker.plans) == (2 if overlap else 1)
        await h.step([99])  # a stop token: a finishes at step 0
        assert h.outs_of("a")[-1].finish_reason == FinishReason.stop(99)
        if overlap:  # ... but it is in step 1 already: nothing is released yet
            assert h.kv.num_reqs() == 1 and h.kv.free_slots() == POOL - 4
            await h.step([7])  # the extra token is dropped
        h.assert_no_leak()
        # exactly one output per token; nothing after the finish
        assert [o.ids_delta for o in h.outs_of("a")] == [[99]]
        # the extra step's KV (its input, 99) was cached: prompt + output is reused
        assert h.kv.evictable_slots() == (4 if overlap else 3)
        assert h.kv.core.match_prefix(np.array([1, 2, 3, 99, 5], dtype=np.int32))[0].shape[0] == (4 if overlap else 3)
        assert len(h.worker.plans) == (2 if overlap else 1)
        await h.stop()

    run(body())


def test_abort_mid_flight_frees_once_and_spares_the_others():
    async def body():
        h = Harness()
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=8))
        h.sched.add_request(treq("b", [4, 5], max_new_tokens=3))
        await h.start()
        await h.step([10, 20])  # extend done; decode 1 runs, decode 2 is planned
        row_a = h.sched.reqs["a"].admission.req_pool_idx
        h.sched.end("a", ABORT)
        assert h.outs_of("a")[-1].finish_reason == ABORT  # the consumer hears now
        assert h.kv.num_reqs() == 2  # but two steps in flight still hold a
        await h.step([11, 21])
        await h.step([12, 22])
        # a's tokens after the abort were dropped; b ran to its end untouched
        assert [o.ids_delta for o in h.outs_of("a")] == [[10], []]
        assert [o.ids_delta for o in h.outs_of("b")] == [[20], [21], [22]]
        assert h.outs_of("b")[-1].finish_reason.kind is FinishKind.LENGTH
        # the steps after the abort did not include a
        assert all(row_a not in p.req_pool_indices.tolist() for p in h.worker.plans[3:])
        await settle()
        h.assert_no_leak()
        assert h.kv.evictable_slots() == 4  # b's prompt and first 2 outputs cached; a's KV freed
        await h.stop()

    run(body())


def test_overlap_off_runs_one_step_at_a_time():
    async def body():
        h = Harness(overlap=False)
        h.sched.add_request(treq("a", [1, 2], max_new_tokens=3))
        await h.start()
        for ids in ([5], [6], [7]):
            assert len(h.worker.pending) == 1
            await h.step(ids)
        assert [o.ids_delta for o in h.outs_of("a")] == [[5], [6], [7]]
        assert h.worker.inputs == [[1, 2], [5], [6]]
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_rows_are_reused_and_released_rows_reach_the_worker():
    async def body():
        h = Harness()
        h.sched.add_request(treq("a", [1, 2], max_new_tokens=1))
        await h.start()
        await h.step([5])
        h.assert_no_leak()  # released while idle: the worker was told directly
        h.sched.add_request(treq("b", [3, 4], max_new_tokens=1))
        await settle()
        plan = h.worker.plans[-1]
        assert plan.forward_mode is ForwardMode.EXTEND
        assert h.worker.num_live_sampling_rows == 0  # the plan has not run yet
        await h.step([6])
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_rid_reused_before_the_old_request_is_released():
    async def body():
        h = Harness()
        h.sched.add_request(treq("R", [1, 2, 3]))
        await h.start()
        h.sched.end("R", ABORT)  # the client left; its step is still in flight
        h.sched.add_request(treq("R", [4, 5]))  # a new request reuses the rid meanwhile
        await h.step([7])
        while h.worker.pending:
            await h.step([8] * h.worker.pending[0][0].batch_size)
        assert h.outs_of("R")[0].finish_reason == ABORT
        assert h.outs_of("R")[-1].finish_reason.kind is FinishKind.LENGTH
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_a_failed_extra_step_frees_the_kv_of_a_finished_request_uncached():
    async def body():
        h = Harness()
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=10, stop={99}))
        await h.start()
        await h.step([99])  # a stops; step 1 (writing 99's KV) is in flight
        h.worker.fail_next(RuntimeError("device lost"))
        await settle()
        h.assert_no_leak()
        assert h.kv.evictable_slots() == 0  # nothing of a cached: step 1 may not have written
        assert h.outs_of("a")[-1].finish_reason == FinishReason.stop(99)  # its answer stands
        await h.stop()

    run(body())


def test_pool_full_with_a_step_in_flight_drains_then_retracts_without_waiting():
    async def body():
        h = Harness()
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=6))
        h.sched.add_request(treq("b", [4, 5], max_new_tokens=6))
        await h.start()
        await h.step([10, 20])  # decode 1 runs; decode 2 was planned
        real = h.kv.prepare_decode
        calls: list[list[int]] = []

        def full_twice(req_ids):  # the pool is "full" for the next two decode plans
            calls.append([int(r) for r in req_ids])
            return None if len(calls) <= 2 else real(req_ids)

        h.kv.prepare_decode = full_twice
        await h.step([11, 21])  # decode 1 done; planning decode 3 finds the pool full
        assert h.sched.pipeline.need_drain and len(calls) == 1
        await h.step([12, 22])  # the drain: decode 2 processed, then at once: full again with
        # nothing in flight, so by SGLang's rule a (as many outputs as b, the longer prompt) is
        # retracted and b goes on, with no new request or wake-up needed
        a_id, b_id = h.sched.reqs["a"].admission.req_id, h.sched.reqs["b"].admission.req_id
        assert calls[2] == [b_id]
        # a's re-prefill was planned behind b's decode; being a prefill of a request in no
        # other step, the decode after it (b, then a) is planned at once, a third step
        assert len(calls) == 4 and calls[3] == [b_id, a_id] and len(h.worker.pending) == 3
        assert [r.rid for r in h.sched.waiting] == [] and h.sched.reqs["a"].num_retractions == 1
        assert h.sched.reqs["b"].num_retractions == 0
        # SGLang's new estimate after a retraction: (b's 2 tokens + 20 steps) / its 6, at most
        # 1; then the two decode steps planned right after it decayed it twice
        assert h.sched.planner.new_token_ratio.value == pytest.approx(1.0 - 2 * (0.7 - 0.098) / 600)
        # a's computed tokens were cached: it resumes by prefilling only its last token
        resume = h.worker.plans[-2] if h.worker.plans[-1].forward_mode.name == "DECODE" else h.worker.plans[-1]
        assert resume.forward_mode.name == "EXTEND" and resume.extend_lens.tolist() == [1]
        assert h.worker.pending  # the next step (b's re-prefill, a's decode) is already planned
        while h.worker.pending:
            await h.step([30] * h.worker.pending[0][0].batch_size)
        assert sum(len(o.ids_delta) for o in h.outs_of("a")) == 6
        assert sum(len(o.ids_delta) for o in h.outs_of("b")) == 6
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_max_new_tokens_clipped_to_pool_and_context():
    h = Harness(pool=40)
    h.sched.add_request(treq("a", list(range(1, 11)), max_new_tokens=1000))
    assert h.sched.reqs["a"].max_new_tokens == 30  # pool 40 - prompt 10
    h2 = Harness(pool=1000)
    h2.sched.add_request(treq("b", list(range(1, 11)), max_new_tokens=1000))
    assert h2.sched.reqs["b"].max_new_tokens == 54  # context 64 - prompt 10


def test_new_token_ratio_decays_and_decides_admission():
    async def body(conservativeness: float) -> list[str]:
        h = Harness()
        sched = h.sched
        init = min(0.7 * conservativeness, 1.0)
        ratio = sched.planner.new_token_ratio
        ratio.init_value = ratio.value = init
        ratio.min_value = init * 0.14
        ratio.decay_per_step = (init - init * 0.14) / 600
        sched.add_request(treq("a", list(range(1, 11)), max_new_tokens=50))
        sched.add_request(treq("b", list(range(20, 30)), max_new_tokens=40))
        await h.start()
        # round 1: a needs 10 + 50 of the 100 slots; b (10 + 40) does not fit beside it.
        # round 2 (a running, 90 slots left): a keeps 50 x ratio; b fits at 0.7 (35), not at 1.0
        modes = [p.forward_mode.name for p in h.worker.plans[:2]]
        ratio_after = ratio.value
        await h.stop()
        return modes, ratio_after, init

    modes, ratio, init = asyncio.run(body(1.0))
    assert modes == ["EXTEND", "EXTEND"] and init == 0.7
    # the two prefills hold no running request, so the decode step of a and b after them is
    # planned at once (a third step in flight): one decay
    assert ratio == pytest.approx(0.7 - (0.7 - 0.098) / 600)
    modes, ratio, init = asyncio.run(body(10.0))
    assert modes == ["EXTEND", "DECODE"] and init == 1.0
    assert ratio == pytest.approx(1.0 - (1.0 - 0.14) / 600)  # one decode step planned


def test_scheduler_default_new_token_ratio():
    h = Harness()
    ratio = h.sched.planner.new_token_ratio
    assert ratio.value == 0.7 and ratio.min_value == pytest.approx(0.098)
    assert ratio.decay_per_step == pytest.approx((0.7 - 0.098) / 600)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_request_as_large_as_the_pool_runs(page_size):
    """Prompt + max_new_tokens == the pool (which the tokenizer manager lets through): it is
    admitted and runs to the end. Admission counts whole pages exactly; it used to add
    page_size - 1 tokens to the need, so such a request waited forever with pages of 4."""

    async def body():
        h = Harness()
        h.kv = KVCache(40, max_running_requests=4, max_context_len=64, page_size=page_size)
        h.worker = FakeWorker(h.kv)
        h.sched = Scheduler(
            SchedulerConfig(context_len=64, max_running_requests=4, max_prefill_tokens=64),
            h.kv,
            h.worker,
            h.outs.extend,
        )
        h.sched.add_request(treq("a", list(range(1, 11)), max_new_tokens=30))
        await h.start()
        while h.worker.pending:
            await h.step([7] * h.worker.pending[0][0].batch_size)
        await settle()
        assert len(h.outs_of("a")) == 30
        assert h.outs_of("a")[-1].finish_reason == FinishReason.length_limit(30)
        h.kv.core.check_integrity()
        assert h.kv.num_reqs() == 0 and h.kv.free_slots() + h.kv.evictable_slots() == 40
        await h.stop()

    run(body())
