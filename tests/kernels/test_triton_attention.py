"""The Triton paged attention kernels (pyserve_kernels.triton_ops: split-KV decode and extend
over a cached prefix) against the fp32 torch references in pyserve_kernels.reference. Without
CUDA they run on CPU under TRITON_INTERPRET=1, so shapes stay small."""

from __future__ import annotations

import os
import re

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from pyserve_kernels import reference  # noqa: E402
from pyserve_kernels.triton_ops.decode_attention import decode_attention_fwd, decode_workspace  # noqa: E402
from pyserve_kernels.triton_ops.extend_attention import extend_attention_fwd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


class PagedKV:
    """A KV pool and req_to_token rows laid out as the allocator would: with page_size 1,
    shuffled single slots; otherwise whole pages of page_size consecutive slots, starting at a
    multiple of page_size, the requests' pages shuffled together. Slot 0 (padding) and every
    unused slot hold NaN, so a kernel that reads outside a request's keys fails."""

    def __init__(
        self, total_lens: list[int], page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        batch = len(total_lens)
        max_context = max(16, -(-max(total_lens) // 16) * 16 + 16)
        num_rows = batch + 2
        self.req_to_token = torch.zeros(num_rows, max_context, dtype=torch.int32)
        self.req_pool_indices = torch.randperm(num_rows, generator=gen)[:batch]
        pages_per_req = [-(-n // page_size) for n in total_lens]
        num_pages = sum(pages_per_req) + 3
        pages = torch.randperm(num_pages - 1, generator=gen)[: sum(pages_per_req)] + 1
        used = []
        for b, n in enumerate(total_lens):
            first = sum(pages_per_req[:b])
            mine = pages[first : first + pages_per_req[b]]
            slots = (mine[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
            self.req_to_token[self.req_pool_indices[b], :n] = slots.to(torch.int32)
            used.append(slots)
        used_slots = torch.cat(used)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k_buffer = torch.full(shape, float("nan"))
        self.v_buffer = torch.full(shape, float("nan"))
        self.k_buffer[used_slots] = torch.randn(len(used_slots), num_kv_heads, head_dim, generator=gen)
        self.v_buffer[used_slots] = torch.randn(len(used_slots), num_kv_heads, head_dim, generator=gen)
        self.k_buffer = self.k_buffer.to(dtype)
        self.v_buffer = self.v_buffer.to(dtype)

    def to(self, device: str) -> PagedKV:
        for name in ("req_to_token", "req_pool_indices", "k_buffer", "v_buffer"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def kv_indptr_indices(self, starts: list[int], ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """CSR (kv_indptr, kv_indices) of positions starts[b]:ends[b] for reference.decode_attention."""
        rows = self.req_pool_indices.tolist()
        indices = torch.cat([self.req_to_token[r, s:e] for r, s, e in zip(rows, starts, ends)])
        indptr = torch.tensor([0] + [e - s for s, e in zip(starts, ends)]).cumsum(0)
        return indptr.to(indices.device), indices


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def run_decode(
    seq_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    page_size,
    dtype,
    seed=0,
    sliding_window=None,
    num_kv_splits=None,
    index_dtype=torch.int64,
    device=DEVICE,
    workspace_batch=None,
):
    """(kernel output, reference output) of one decode batch."""
    kv = PagedKV(seq_lens, page_size, num_kv_heads, head_dim, dtype, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    scaling = head_dim**-0.5
    workspace = None
    if workspace_batch is not None:
        workspace = decode_workspace(workspace_batch, num_heads, head_dim, num_kv_splits, device)
        workspace.fill_(float("nan"))
    out = decode_attention_fwd(
        q,
        kv.k_buffer,
        kv.v_buffer,
        kv.req_to_token,
        kv.req_pool_indices.to(index_dtype),
        torch.tensor(seq_lens, dtype=index_dtype, device=device),
        scaling,
        sliding_window=sliding_window,
        num_kv_splits=num_kv_splits,
        out=nan_like(q),
        workspace=workspace,
    )
    indptr, indices = kv.kv_indptr_indices([0] * len(seq_lens), seq_lens)
    expected = reference.decode_attention(
        q.float(), kv.k_buffer.float(), kv.v_buffer.float(), indptr, indices, scaling, sliding_window
    )
    return out, expected


def run_extend(
    prefix_lens,
    extend_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    page_size,
    dtype,
    seed=0,
    sliding_window=None,
    index_dtype=torch.int64,
    device=DEVICE,
):
    """(kernel output, reference output) of one extend batch."""
    totals = [p + e for p, e in zip(prefix_lens, extend_lens)]
    kv = PagedKV(totals, page_size, num_kv_heads, head_dim, dtype, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(extend_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    scaling = head_dim**-0.5
    prefix = torch.tensor(prefix_lens, dtype=index_dtype, device=device)
    extend = torch.tensor(extend_lens, dtype=index_dtype, device=device)
    qo_indptr = torch.tensor([0] + extend_lens, device=device).cumsum(0).to(index_dtype)
    out = extend_attention_fwd(
        q,
        kv.k_buffer,
        kv.v_buffer,
        kv.req_to_token,
        kv.req_pool_indices.to(index_dtype),
        prefix,
        extend,
        qo_indptr,
        max(extend_lens),
        scaling,
        sliding_window=sliding_window,
        out=nan_like(q),
    )
    expected = reference.extend_attention(
        q.float(),
        kv.k_buffer.float(),
        kv.v_buffer.float(),
        kv.req_to_token,
        kv.req_pool_indices,
        prefix,
        extend,
        scaling,
        sliding_window,
    )
    return out, expected


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


# Keys per request: fewer than the 8 splits (1, 5), none (0), and more than 8 splits * 32
# keys per block (300).
DECODE_SEQ_LENS = [5, 300, 1, 0, 40]


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim,page_size", [(64, 1), (128, 16)])
def test_decode_matches_reference(group: int, head_dim: int, page_size: int) -> None:
    out, expected = run_decode(DECODE_SEQ_LENS, 2 * group, 2, head_dim, page_size, torch.float32)
    assert_close(out, expected, torch.float32)
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # the request with no keys


@pytest.mark.parametrize("group,page_size", [(1, 16), (4, 1)])
def test_decode_float16(group: int, page_size: int) -> None:
    out, expected = run_decode(DECODE_SEQ_LENS, group, 1, 64, page_size, torch.float16, seed=3)
    assert out.dtype == torch.float16
    assert_close(out, expected, torch.float16)


@pytest.mark.parametrize("sliding_window", [1, 7, 64, 1000])
def test_decode_sliding_window(sliding_window: int) -> None:
    out, expected = run_decode(DECODE_SEQ_LENS, 4, 2, 64, 16, torch.float32, seed=5, sliding_window=sliding_window)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("num_kv_splits", [1, 3, 16])
def test_decode_num_kv_splits_and_int32_indices(num_kv_splits: int) -> None:
    out, expected = run_decode(
        [2, 97, 0, 12], 4, 2, 64, 1, torch.float32, seed=7, num_kv_splits=num_kv_splits, index_dtype=torch.int32
    )
    assert_close(out, expected, torch.float32)


def test_decode_preallocated_workspace_for_a_larger_batch() -> None:
    # As under a CUDA graph: the workspace of the largest batch, left uninitialised (NaN).
    out, expected = run_decode([3, 50, 9], 2, 1, 64, 16, torch.float32, seed=9, num_kv_splits=4, workspace_batch=8)
    assert_close(out, expected, torch.float32)


def test_decode_head_dim_not_a_power_of_two() -> None:
    out, expected = run_decode([6, 45], 2, 1, 80, 1, torch.float32, seed=11)
    assert_close(out, expected, torch.float32)


# (prefix_len, extend_len): fresh prefills (extend 1 and 37), a cached prefix with a few new
# tokens, a decode-like step (extend 1 after 70 cached), and a long extend over two query tiles.
EXTEND_CASES = [(0, 1), (0, 37), (20, 5), (70, 1), (33, 80)]


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim,page_size", [(64, 1), (128, 16)])
def test_extend_matches_reference(group: int, head_dim: int, page_size: int) -> None:
    prefix, extend = map(list, zip(*EXTEND_CASES))
    out, expected = run_extend(prefix, extend, group, 1, head_dim, page_size, torch.float32)
    assert_close(out, expected, torch.float32)


def test_extend_gqa_with_two_kv_heads() -> None:
    out, expected = run_extend([9, 0], [20, 3], 8, 2, 64, 16, torch.float32, seed=2)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("group,page_size", [(1, 16), (2, 1)])
def test_extend_float16(group: int, page_size: int) -> None:
    out, expected = run_extend([0, 17, 40], [30, 4, 1], group, 1, 64, page_size, torch.float16, seed=4)
    assert out.dtype == torch.float16
    assert_close(out, expected, torch.float16)


@pytest.mark.parametrize("sliding_window", [1, 5, 40])
def test_extend_sliding_window(sliding_window: int) -> None:
    out, expected = run_extend(
        [0, 50, 13],
        [70, 6, 1],
        2,
        1,
        64,
        16,
        torch.float32,
        seed=6,
        sliding_window=sliding_window,
        index_dtype=torch.int32,
    )
    assert_close(out, expected, torch.float32)


def test_extend_head_dim_not_a_power_of_two() -> None:
    out, expected = run_extend([4, 0], [9, 3], 2, 1, 80, 1, torch.float32, seed=8)
    assert_close(out, expected, torch.float32)


def test_extend_equals_decode_for_one_new_token() -> None:
    extend_out, _ = run_extend([0, 6, 70], [1, 1, 1], 4, 2, 64, 16, torch.float32, seed=12)
    decode_out, _ = run_decode([1, 7, 71], 4, 2, 64, 16, torch.float32, seed=12)
    torch.testing.assert_close(extend_out, decode_out, atol=2e-6, rtol=1e-5)


def test_extend_reference_matches_sdpa() -> None:
    # Independent check of reference.extend_attention: no prefix, contiguous slots.
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(11, 4, 16, generator=gen) for _ in range(3))
    k, v = k[:, ::2].contiguous(), v[:, ::2].contiguous()  # 2 KV heads
    req_to_token = torch.arange(11, dtype=torch.int32)[None]
    got = reference.extend_attention(
        q, k, v, req_to_token, torch.tensor([0]), torch.tensor([0]), torch.tensor([11]), 0.25
    )
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
        scale=0.25,
    ).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def decode_args(**change):
    args = dict(
        q=torch.zeros(2, 4, 64),
        k_buffer=torch.zeros(32, 2, 64),
        v_buffer=torch.zeros(32, 2, 64),
        req_to_token=torch.zeros(3, 16, dtype=torch.int32),
        req_pool_indices=torch.tensor([0, 1]),
        seq_lens=torch.tensor([1, 2]),
        scaling=0.125,
    )
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(q=torch.zeros(2, 256)), "q must be 3-D"),
        (dict(q=torch.zeros(2, 3, 64)), "num_heads 3 not divisible by num_kv_heads 2"),
        (dict(v_buffer=torch.zeros(32, 2, 64, dtype=torch.float16)), "v_buffer dtype torch.float16"),
        (dict(k_buffer=torch.zeros(32, 2, 64, device="meta")), "k_buffer on meta"),
        (dict(k_buffer=torch.zeros(32, 2, 32), v_buffer=torch.zeros(32, 2, 32)), "head_dim of q 64"),
        (dict(seq_lens=torch.tensor([1.0, 2.0])), "seq_lens must be int32 or int64"),
        (dict(req_pool_indices=torch.tensor([0, 1, 2])), "must both be [2]"),
        (dict(req_to_token=torch.zeros(16, dtype=torch.int32)), "req_to_token must be 2-D"),
        (dict(sliding_window=0), "sliding_window must be None or an int >= 1"),
        (dict(num_kv_splits=0), "num_kv_splits must be an int >= 1"),
        (dict(out=torch.zeros(2, 4, 64, dtype=torch.float16)), "out must be (2, 4, 64) torch.float32"),
        (dict(workspace=torch.zeros(2, 4, 8, 64)), "workspace must be float32 [>=2, 4, 8, 65]"),
    ],
)
def test_decode_argument_errors(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        decode_attention_fwd(**decode_args(**change))
    assert str(err.value).startswith("decode_attention_fwd: ")


def extend_args(**change):
    args = dict(
        q=torch.zeros(3, 4, 64),
        k_buffer=torch.zeros(32, 2, 64),
        v_buffer=torch.zeros(32, 2, 64),
        req_to_token=torch.zeros(3, 16, dtype=torch.int32),
        req_pool_indices=torch.tensor([0, 1]),
        prefix_lens=torch.tensor([0, 4]),
        extend_lens=torch.tensor([1, 2]),
        qo_indptr=torch.tensor([0, 1, 3]),
        max_extend_len=2,
        scaling=0.125,
    )
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(q=torch.zeros(3, 4, 8, 8)), "q must be 3-D"),
        (
            dict(k_buffer=torch.zeros(32, 3, 64), v_buffer=torch.zeros(32, 3, 64)),
            "num_heads 4 not divisible by num_kv_heads 3",
        ),
        (dict(qo_indptr=torch.tensor([0, 1])), "qo_indptr must be [3]"),
        (dict(extend_lens=torch.tensor([1, 2, 3])), "must both be [2] like req_pool_indices"),
        (dict(prefix_lens=torch.tensor([0, 4], device="meta")), "prefix_lens on meta"),
        (dict(req_to_token=torch.zeros(3, 16, dtype=torch.int16)), "req_to_token must be int32 or int64"),
        (dict(max_extend_len=torch.tensor(2)), "max_extend_len must be a host int >= 0"),
        (dict(sliding_window=2.5), "sliding_window must be None or an int >= 1"),
    ],
)
def test_extend_argument_errors(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        extend_attention_fwd(**extend_args(**change))
    assert str(err.value).startswith("extend_attention_fwd: ")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("group", [1, 4, 8])
def test_large_bfloat16_on_cuda(group: int) -> None:
    out, expected = run_decode([1, 17, 900, 4096, 0, 333] * 4, 8 * group, 8, 128, 16, torch.bfloat16, seed=21)
    assert_close(out, expected, torch.bfloat16)
    prefix = [0, 1000, 37, 2048, 5]
    extend = [700, 1, 300, 129, 1024]
    out, expected = run_extend(prefix, extend, 8 * group, 8, 128, 16, torch.bfloat16, seed=22)
    assert_close(out, expected, torch.bfloat16)
    out, expected = run_extend(prefix, extend, 4 * group, 4, 128, 1, torch.bfloat16, seed=23, sliding_window=256)
    assert_close(out, expected, torch.bfloat16)
