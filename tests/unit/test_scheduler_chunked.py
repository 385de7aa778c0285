"""Chunked prefill in the scheduler, against the fake worker of test_scheduler: exact chunk
boundaries and plans, chunks taking turns with the running requests' decode steps, chunk
tokens never emitted, the chunks' pages cached for a request arriving meanwhile, aborts
mid-prefill, prompt-logprob requests kept whole, and no leak."""

from __future__ import annotations

from pyserve.engine.scheduler import Scheduler
from pyserve.engine.scheduler_config import SchedulerConfig
from pyserve.forward_batch_info import EndCause, FinishReason
from pyserve.io_struct import LogprobParams, TokenizedGenerateReq
from pyserve.mem_cache.kv_cache import KVCache
from pyserve.sampling_params import SamplingParams

from .test_scheduler import POOL, FakeWorker, Harness, run, settle, treq  # noqa: F401

LONG = list(range(30, 50))  # 20 tokens: chunks of 5 (what the first batch leaves), 8 and 7


class ChunkHarness(Harness):
    def __init__(self, overlap: bool = False, chunk: int = 8, page_size: int = 1) -> None:
        self.outs = []
        self.kv = KVCache(POOL, max_running_requests=4, max_context_len=64, page_size=page_size)
        self.worker = FakeWorker(self.kv)
        config = SchedulerConfig(
            context_len=64, max_running_requests=4, max_prefill_tokens=64, overlap=overlap, chunked_prefill_size=chunk
        )
        self.sched = Scheduler(config, self.kv, self.worker, emit=self.outs.extend)


def shape(plan):
    """(mode, rows' seq_lens, positions, input ids or None, rows starting sampling)."""
    return (
        plan.forward_mode.name,
        plan.seq_lens.tolist(),
        plan.positions.tolist(),
        None if plan.input_ids is None else plan.input_ids.tolist(),
        [r.req_pool_idx for r in plan.new_sampling_rows],
    )


def test_chunk_boundaries_and_turns_with_decode():
    async def body():
        h = ChunkHarness()
        h.sched.add_request(treq("r", [1, 2, 3], max_new_tokens=6))
        h.sched.add_request(treq("long", LONG, max_new_tokens=2))
        await h.start()
        plans = h.worker.plans
        r_row, long_row = plans[0].req_pool_indices.tolist()
        # batch 1: r whole (3 tokens), then the first 5 of long: the chunk budget of 8 is used
        assert shape(plans[0]) == ("EXTEND", [3, 5], [0, 1, 2, 0, 1, 2, 3, 4], [1, 2, 3, 30, 31, 32, 33, 34], [r_row])
        assert plans[0].prefix_lens.tolist() == [0, 0] and plans[0].extend_lens.tolist() == [3, 5]
        await h.step([10, 99])  # 99: long's chunk token, dropped
        assert [(o.rid, o.ids_delta) for o in h.outs] == [("r", [10])]
        # the running request decodes between long's chunks
        assert shape(plans[1]) == ("DECODE", [4], [3], None, [])
        await h.step([11])
        assert shape(plans[2]) == ("EXTEND", [13], list(range(5, 13)), LONG[5:13], [])
        # its row: the first chunk's slots, then the second's (slot 9 went to r's decode)
        assert plans[2].prefix_lens.tolist() == [5]
        assert plans[2].row_slots.tolist() == list(range(4, 9)) + list(range(10, 18))
        # the first chunk's tokens are in the radix cache now, locked by long
        assert h.kv.protected_slots() == 5
        await h.step([98])
        assert shape(plans[3]) == ("DECODE", [5], [4], None, [])
        await h.step([12])
        # the last chunk: long's sampling row starts, its token is its first output
        assert shape(plans[4]) == ("EXTEND", [20], list(range(13, 20)), LONG[13:], [long_row])
        assert h.kv.protected_slots() == 13
        await h.step([50])
        assert shape(plans[5]) == ("DECODE", [6, 21], [5, 20], None, [])
        await h.step([13, 51])
        await h.step([14])
        await h.step([15])
        assert [o.ids_delta for o in h.outs_of("long")] == [[50], [51]]
        assert [t for o in h.outs_of("r") for t in o.ids_delta] == [10, 11, 12, 13, 14, 15]
        # the decode inputs were the sampled tokens, never a chunk's dropped one
        assert h.worker.inputs[5] == [12, 50]
        assert len(plans) == 8 and not h.worker.pending
        await settle()
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_overlap_plans_the_same_chunks():
    async def body():
        h = ChunkHarness(overlap=True)
        h.sched.add_request(treq("r", [1, 2, 3], max_new_tokens=6))
        h.sched.add_request(treq("long", LONG, max_new_tokens=2))
        await h.start()
        for ids in ([10, 99], [11], [98], [12], [50], [13, 51], [14], [15]):
            await h.step(ids)
        modes = [(p.forward_mode.name, p.seq_lens.tolist()) for p in h.worker.plans]
        assert modes == [
            ("EXTEND", [3, 5]),
            ("DECODE", [4]),
            ("EXTEND", [13]),
            ("DECODE", [5]),
            ("EXTEND", [20]),
            ("DECODE", [6, 21]),
            ("DECODE", [7]),
            ("DECODE", [8]),
        ]
        assert [o.ids_delta for o in h.outs_of("long")] == [[50], [51]]
        assert [t for o in h.outs_of("r") for t in o.ids_delta] == [10, 11, 12, 13, 14, 15]
        await settle()
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_a_request_arriving_meanwhile_reuses_the_chunks():
    async def body():
        h = ChunkHarness()
        h.sched.add_request(treq("long", LONG, max_new_tokens=1))
        await h.start()
        assert shape(h.worker.plans[0])[:2] == ("EXTEND", [8])
        h.sched.add_request(treq("twin", LONG + [60], max_new_tokens=1))
        await h.step([99])
        # long's chunks come first; twin waits behind the chunked request
        assert h.worker.plans[1].seq_lens.tolist() == [16] and h.worker.plans[1].batch_size == 1
        await h.step([98])
        # long's last 4 tokens, then twin in the same batch: 16 of its tokens were cached, and
        # what is left of the chunk budget (4) cuts it in turn
        last = h.worker.plans[2]
        assert last.seq_lens.tolist() == [20, 20] and last.prefix_lens.tolist() == [16, 16]
        assert last.extend_lens.tolist() == [4, 4]
        assert [r.req_pool_idx for r in last.new_sampling_rows] == last.req_pool_indices.tolist()[:1]
        await h.step([50, 97])
        assert h.worker.plans[3].prefix_lens.tolist() == [20] and h.worker.plans[3].extend_lens.tolist() == [1]
        await h.step([70])
        assert [(o.rid, o.ids_delta, o.cached_tokens) for o in h.outs] == [("long", [50], 0), ("twin", [70], 16)]
        await settle()
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_abort_mid_prefill_frees_everything():
    async def body():
        h = ChunkHarness(overlap=True)
        h.sched.add_request(treq("long", LONG, max_new_tokens=3))
        await h.start()
        assert [p.seq_lens.tolist() for p in h.worker.plans] == [[8], [16]]  # overlap: 2 chunks planned
        h.sched.end("long", FinishReason.abort(EndCause.CLIENT_GONE, "gone"))
        await h.step([99])
        await h.step([98])
        assert len(h.worker.plans) == 2  # nothing more was planned for it
        assert [(o.rid, o.ids_delta, o.finish_reason.kind.name) for o in h.outs] == [("long", [], "ABORT")]
        await settle()
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_prompt_logprob_requests_are_not_chunked():
    async def body():
        h = ChunkHarness()
        sp = SamplingParams(max_new_tokens=1, temperature=0.0)
        h.sched.add_request(
            TokenizedGenerateReq("lp", LONG, sp, frozenset(), LogprobParams(return_logprob=True, logprob_start_len=0))
        )
        await h.start()
        assert h.worker.plans[0].seq_lens.tolist() == [20]  # one extend, past the chunk size
        h.worker.run_next([5])
        await settle()
        assert [o.ids_delta for o in h.outs] == [[5]]
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_page_aligned_chunks():
    async def body():
        h = ChunkHarness(chunk=10, page_size=4)
        h.sched.add_request(treq("long", LONG, max_new_tokens=1))
        await h.start()
        # chunks end on page boundaries: 8 (of a budget of 10), 16, then the last 4
        for ids in ([99], [98], [50]):
            await h.step(ids)
        assert [(p.prefix_lens.tolist(), p.extend_lens.tolist()) for p in h.worker.plans] == [
            ([0], [8]),
            ([8], [8]),
            ([16], [4]),
        ]
        assert [o.ids_delta for o in h.outs] == [[50]]
        await settle()
        h.kv.core.check_integrity()
        assert h.kv.num_reqs() == 0 and h.worker.num_live_sampling_rows == 0
        await h.stop()

    run(body())


class MixedHarness(ChunkHarness):
    def __init__(self, overlap: bool = False) -> None:
        super().__init__(overlap=overlap)
        self.sched.planner.enable_mixed_chunk = True


def test_mixed_chunk_carries_the_decodes_in_each_prefill_step():
    async def body():
        h = MixedHarness()
        h.sched.add_request(treq("r", [1, 2, 3], max_new_tokens=5))
        await h.start()
        await h.step([10])  # r's prefill
        h.sched.add_request(treq("long", LONG, max_new_tokens=2))
        await h.step([11])  # r's first decode (planned before long came)
        plans = h.worker.plans
        r_row = plans[0].req_pool_indices.tolist()[0]
        # long's chunks with r's decode token in each: rows [long, r], r's input from the table
        assert shape(plans[2])[:3] == ("EXTEND", [8, 5], list(range(8)) + [4])
        assert plans[2].input_ids.tolist() == LONG[:8] and plans[2].num_decode_rows == 1
        assert plans[2].req_pool_indices.tolist()[1] == r_row and plans[2].extend_lens.tolist() == [8, 1]
        assert plans[2].new_sampling_rows == []  # long's row starts with its last chunk
        await h.step([99, 12])
        assert h.worker.inputs[2] == LONG[:8] + [11]
        assert shape(plans[3])[:3] == ("EXTEND", [16, 6], list(range(8, 16)) + [5])
        await h.step([98, 13])
        assert shape(plans[4])[:3] == ("EXTEND", [20, 7], list(range(16, 20)) + [6])
        assert [s.req_pool_idx for s in plans[4].new_sampling_rows] == plans[4].req_pool_indices.tolist()[:1]
        await h.step([50, 14])
        assert shape(plans[5])[:2] == ("DECODE", [21])  # r is done (5 tokens); long decodes
        await h.step([51])
        assert [t for o in h.outs_of("r") for t in o.ids_delta] == [10, 11, 12, 13, 14]
        assert [t for o in h.outs_of("long") for t in o.ids_delta] == [50, 51]
        await settle()
        h.assert_no_leak()
        await h.stop()

    run(body())


def test_a_full_pool_sends_the_chunked_prompt_back_not_the_running_request():
    """The pool (40) fills while a 33-token prompt is chunked beside a running request: the
    decode step after a chunk finds no slot, and the chunked request (no output yet, holding
    its chunks) goes back to wait; the running request is not cut short. (Found in review:
    it used to end the lone running request with reason length.)"""

    async def body():
        h = ChunkHarness(chunk=8)
        h.kv = KVCache(40, max_running_requests=4, max_context_len=64)
        h.worker = FakeWorker(h.kv)
        config = SchedulerConfig(
            context_len=64,
            max_running_requests=4,
            max_prefill_tokens=64,
            overlap=False,
            chunked_prefill_size=8,
            schedule_conservativeness=0.01,
        )
        h.sched = Scheduler(config, h.kv, h.worker, emit=h.outs.extend)
        h.sched.add_request(treq("A", [1, 2, 3], max_new_tokens=30))
        await h.start()
        await h.step([10])
        await h.step([11])
        h.sched.add_request(treq("B", list(range(30, 63)), max_new_tokens=1))
        await settle()
        while h.worker.pending:
            await h.step([12] * h.worker.pending[0][0].batch_size)
        outs = {rid: [t for o in h.outs_of(rid) for t in o.ids_delta] for rid in ("A", "B")}
        assert len(outs["A"]) == 30 and len(outs["B"]) == 1
        assert {o.rid: o.finish_reason.length for o in h.outs if o.finish_reason is not None} == {"A": 30, "B": 1}
        assert h.sched.reqs == {} and h.kv.num_reqs() == 0
        h.kv.core.check_integrity()
        assert h.kv.free_slots() + h.kv.evictable_slots() == 40 and h.worker.num_live_sampling_rows == 0
        await h.stop()

    run(body())
