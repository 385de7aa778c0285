"""One index dtype from the Rust core to the device (DESIGN.md section 4): the real scheduler and
Rust core plan a prefill, a decode and a mixed chunk, and every hop is checked for exact
dtypes and counted conversions: the plan's index arrays ARE the Rust core's int32 arrays (no
host copy or cast), the worker packs them into one int32 host array, copies it to the device
once with no dtype change, writes its int32 tables, and the CPU attention backend's metadata
and kernels run on it with no conversion and no int64 intermediate. The one conversion of a
step is the sampled ids' (torch's sampling ops return int64), into the int32 token table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pyserve.forward_batch_info import ForwardBatch, ForwardMode
from pyserve.layers.attention.cpu_backend import CpuAttnBackend
from pyserve.mem_cache.memory_pool import MHATokenToKVPool
from pyserve.model_executor import device_state

from .test_scheduler import Harness, run, settle, treq

# StepPlan field -> the Rust BatchArrays field it must be (the same object)
FROM_RUST = {
    "req_pool_indices": "req_pool_indices",
    "seq_lens": "seq_lens",
    "positions": "positions",
    "out_cache_loc": "out_cache_loc",
    "prefix_lens": "prefix_lens",
    "extend_lens": "extend_lens",
    "row_slots": "kv_indices",
}
PLAN_INDEX_ARRAYS = (*FROM_RUST, "input_ids")
BATCH_INDEX_TENSORS = (
    "input_ids",
    "positions",
    "out_cache_loc",
    "seq_lens",
    "req_pool_indices",
    "kv_indptr",
    "kv_indices",
    "extend_prefix_lens",
    "extend_seq_lens",
)


class Recorder(TorchDispatchMode):
    """Every torch op run under it that changes a tensor's dtype (`.to`, `.long()`, `.int()`,
    `copy_` between dtypes: all reach the dispatcher as `_to_copy` or `copy_`), and every op
    that produces an int64 tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.conversions: list[tuple[str, torch.dtype, torch.dtype]] = []
        self.int64_outputs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "_to_copy" and src is not None and kwargs.get("dtype", src.dtype) != src.dtype:
            self.conversions.append((name, src.dtype, kwargs["dtype"]))
        if name == "copy_" and isinstance(args[1], torch.Tensor) and args[1].dtype != args[0].dtype:
            self.conversions.append((name, args[1].dtype, args[0].dtype))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in outs):
            self.int64_outputs.append(name)
        return out


def test_index_arrays_are_int32_from_the_rust_core_to_the_device_with_no_conversion(monkeypatch):
    if not CpuAttnBackend.supported(MHATokenToKVPool(8, 1, 1, 4, torch.float32, "cpu")):
        pytest.skip("pyserve_kernels._cpu is not built")
    rust_arrays: list = []
    copies: list[tuple[np.dtype, torch.dtype, int]] = []
    steps: list[tuple[object, ForwardBatch, Recorder]] = []
    sampled: list[Recorder] = []
    real_to_device = device_state.to_device

    def to_device(data, dtype, device):
        copies.append((data.dtype, dtype, data.shape[0]))
        return real_to_device(data, dtype, device)

    monkeypatch.setattr(device_state, "to_device", to_device)

    async def body() -> None:
        h = Harness(overlap=False)
        h.sched.planner.enable_mixed_chunk = True
        for name in ("prepare_extend", "prepare_decode"):
            real = getattr(h.kv, name)

            def record(*args, _real=real):
                arrays = _real(*args)
                rust_arrays.append(arrays)
                return arrays

            monkeypatch.setattr(h.kv, name, record)
        state = h.worker.state
        real_forward_batch, real_record_sampled = state.forward_batch, state.record_sampled

        def forward_batch(plan):
            with Recorder() as rec:
                batch = real_forward_batch(plan)
            steps.append((plan, batch, rec))
            return batch

        def record_sampled(plan, batch, next_ids):
            with Recorder() as rec:
                ids = real_record_sampled(plan, batch, next_ids)
            sampled.append(rec)
            return ids

        monkeypatch.setattr(state, "forward_batch", forward_batch)
        monkeypatch.setattr(state, "record_sampled", record_sampled)
        h.sched.add_request(treq("a", [1, 2, 3], max_new_tokens=5))
        await h.start()
        await h.step([10])  # the prefill
        h.sched.add_request(treq("b", [4, 5, 6, 7], max_new_tokens=2))
        await settle()
        for _ in range(8):  # a's decodes, b's prefill (beside a decode: a mixed chunk), ...
            if not h.worker.pending:
                break
            await h.step([11 + i for i in range(h.worker.pending[0][0].batch_size)])
        await h.stop()

    run(body())
    assert len(steps) >= 3 and len(rust_arrays) == len(steps)
    modes = [plan.forward_mode for plan, _, _ in steps]
    assert modes[:2] == [ForwardMode.EXTEND, ForwardMode.DECODE] and ForwardMode.DECODE in modes[3:]
    assert [plan.num_decode_rows for plan, _, _ in steps][2] == 1  # b's prefill beside a's decode
    pool = MHATokenToKVPool(h_pool_size(steps), 1, 1, 4, torch.float32, "cpu")  # 1 layer, 1 KV head
    backend = CpuAttnBackend(pool)
    for (plan, batch, rec), arrays in zip(steps, rust_arrays):
        extend = plan.forward_mode is ForwardMode.EXTEND
        # Rust -> plan: the very arrays the Rust core returned (no copy, no cast), all int32
        for field, rust_field in FROM_RUST.items():
            if getattr(plan, field) is not None:
                assert getattr(plan, field) is getattr(arrays, rust_field), field
        assert {f: getattr(plan, f).dtype for f in PLAN_INDEX_ARRAYS if getattr(plan, f) is not None} == {
            f: np.dtype(np.int32) for f in PLAN_INDEX_ARRAYS if getattr(plan, f) is not None
        }
        # plan -> device: no torch op converted a dtype while the batch was built
        assert rec.conversions == []
        # device: every index tensor int32; all but the token table's ids and the gathered
        # decode rows are views of the one packed copy
        tensors = {f: getattr(batch, f) for f in BATCH_INDEX_TENSORS if getattr(batch, f) is not None}
        assert {f: t.dtype for f, t in tensors.items()} == {f: torch.int32 for f in tensors}
        packed = {f for f in tensors if f != "input_ids" or (extend and not plan.num_decode_rows)}
        assert len({tensors[f].untyped_storage().data_ptr() for f in packed}) == 1
        # attention metadata and one layer's attention (native store_kv and decode kernel, or
        # the torch reference for a prefill): no conversion and no int64 tensor
        with torch.inference_mode(), Recorder() as att:
            backend.init_forward_metadata(batch)
            q = torch.randn(batch.positions.shape[0], 2, 4)
            k = torch.randn(batch.positions.shape[0], 1, 4)
            backend.forward(q, k, k.clone(), 0, 0.5, batch)
        assert att.conversions == [] and att.int64_outputs == []
    assert [(c[0], c[1]) for c in copies] == [(np.dtype(np.int32), torch.int32)] * len(steps)  # one copy a step
    # the only conversion of a step: the sampled ids (int64 from torch's sampling ops) once
    assert [rec.conversions for rec in sampled] == [[("_to_copy", torch.int64, torch.int32)]] * len(sampled)


def h_pool_size(steps) -> int:
    """Slots a KV pool needs for every slot the steps wrote (plus the padding slot 0)."""
    return max(int(batch.out_cache_loc.max()) for _, batch, _ in steps) + 1
