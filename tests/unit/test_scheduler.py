"""Scheduler bookkeeping without a model: admission, release, and rid reuse."""

from __future__ import annotations

from pyserve.engine.scheduler import Scheduler
from pyserve.io_struct import TokenizedGenerateReq
from pyserve.mem_cache.kv_cache import KVCache
from pyserve.model_executor.forward_batch import ForwardMode, StepOutput
from pyserve.sampling_params import SamplingParams

ABORT = {"type": "abort", "message": "test"}


def make_scheduler(pool: int = 100):
    outs: list = []
    kv = KVCache(pool, max_running_requests=4, max_context_len=64)
    sched = Scheduler(kv, worker=None, device="cpu", context_len=64, max_running_requests=4,
                      max_prefill_tokens=64, emit=outs.extend)
    return sched, kv, outs


def treq(rid: str, ids: list[int], max_new_tokens: int = 5) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid, ids, SamplingParams(max_new_tokens=max_new_tokens), frozenset())


def test_extend_then_decode_arrays_and_release():
    sched, kv, outs = make_scheduler()
    sched.add_request(treq("a", [1, 2, 3]))
    batch = sched._get_next_batch()
    assert batch.forward_mode is ForwardMode.EXTEND
    assert batch.input_ids == [1, 2, 3]
    assert batch.arrays.positions.tolist() == [0, 1, 2]
    sched._process_batch_result(batch, StepOutput(next_token_ids=[7]))
    assert [o.ids_delta for o in outs] == [[7]]
    decode = sched._get_next_batch()
    assert decode.forward_mode is ForwardMode.DECODE
    assert decode.input_ids == [7] and decode.seq_lens == [4]
    assert decode.arrays.positions.tolist() == [3]
    assert kv.free_slots() == 100 - 4
    sched._process_batch_result(decode, StepOutput(next_token_ids=[8]))
    assert sched.reqs["a"].output_ids == [7, 8] and sched.reqs["a"].kv_len == 4
    sched.finish_request("a", ABORT)
    sched._release_finished()
    assert kv.free_slots() == 100 and sched.running == [] and sched.reqs == {}


def test_rid_reused_before_the_old_request_is_released():
    sched, kv, outs = make_scheduler()
    sched.add_request(treq("R", [1, 2, 3]))
    sched._process_batch_result(sched._get_next_batch(), StepOutput(next_token_ids=[7]))
    sched.finish_request("R", ABORT)          # the client left; released at the next tick
    sched.add_request(treq("R", [4, 5]))      # a new request reuses the rid meanwhile
    sched._release_finished()                 # releasing the old one must not forget the new one
    assert sched.reqs["R"].origin_input_ids == [4, 5]
    sched.finish_request("R", ABORT)          # so the new one can still be aborted
    assert sched.waiting == type(sched.waiting)() and sched.reqs == {}
    assert outs[-1].rid == "R" and outs[-1].finish_reason == ABORT
    assert kv.free_slots() == 100


def test_max_new_tokens_clipped_to_pool_and_context():
    sched, kv, outs = make_scheduler(pool=40)
    sched.add_request(treq("a", list(range(1, 11)), max_new_tokens=1000))
    assert sched.reqs["a"].max_new_tokens == 30       # pool 40 - prompt 10
    sched2, _, _ = make_scheduler(pool=1000)
    sched2.add_request(treq("b", list(range(1, 11)), max_new_tokens=1000))
    assert sched2.reqs["b"].max_new_tokens == 54      # context 64 - prompt 10
