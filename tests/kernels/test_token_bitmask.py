"""The grammar token-mask op `pyserve_kernels.apply_token_bitmask_` (structured output): the
native CPU kernel (AVX2 and forced scalar), the Triton kernel (under TRITON_INTERPRET=1 on CPU,
small shapes; on the device when CUDA is present) and the public dispatch against the torch
reference, bit for bit; the reference against the bitwise definition of xgrammar's layout and
against xgrammar's own `apply_token_bitmask_inplace` on a mask its GrammarMatcher filled; and
the argument errors of each path."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pyserve_kernels as K  # noqa: E402
from pyserve_kernels import _native, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")

# (batch, vocab, rows): vocab below, at and past a word, not a multiple of 32; no masked rows;
# every row masked; a random subset of rows.
CASES = [
    (4, 100, [2, 0]),
    (3, 32, [0, 1, 2]),
    (5, 33, []),
    (6, 1, [5]),
    (2, 31, [1]),
    (7, 64, [6, 0, 3, 1]),
    (16, 4099, torch.randperm(16, generator=torch.Generator().manual_seed(7))[:9].tolist()),
]


def case_id(case) -> str:
    batch, vocab, rows = case
    return f"B{batch}-V{vocab}-K{len(rows)}"


def make_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Random logits with exact zeros of both signs, whose bits must survive unmasked."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 5
    signed_zero = torch.randint(0, 8, (batch, vocab), generator=gen)
    logits[signed_zero == 0] = -0.0
    logits[signed_zero == 1] = 0.0
    return logits


def make_bitmask(num_masked: int, vocab: int, seed: int) -> torch.Tensor:
    """[num_masked, ceil(vocab / 32)] int32 with words of every kind (all ones, all zeros,
    one bit, bytes each all ones / all zeros / mixed, random) and random bits past the
    vocabulary in the last word."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_masked, (vocab + 31) // 32)
    words = torch.randint(0, 2**32, shape, generator=gen, dtype=torch.int64)
    kind = torch.randint(0, 5, shape, generator=gen)
    words[kind == 0] = 2**32 - 1
    words[kind == 1] = 0
    one_bit = torch.ones(shape, dtype=torch.int64) << torch.randint(0, 32, shape, generator=gen)
    words[kind == 2] = one_bit[kind == 2]
    # bytes of 0x00, 0xFF or random: the 8-token groups the CPU kernel settles byte by byte
    choice = torch.randint(0, 3, (*shape, 4), generator=gen)
    random_bytes = torch.randint(0, 256, (*shape, 4), generator=gen)
    byte_values = torch.where(choice == 0, 0, torch.where(choice == 1, 0xFF, random_bytes))
    by_bytes = (byte_values << torch.tensor([0, 8, 16, 24])).sum(-1)
    words[kind == 3] = by_bytes[kind == 3]
    # two's complement into int32 (1 << 31 is the int32 minimum)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def bitwise(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The layout's definition, one token at a time: bit t % 32 of word t // 32."""
    out = logits.clone()
    for k, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if (int(bitmask[k, t // 32]) >> (t % 32)) & 1 == 0:
                out[row, t] = NEG_INF
    return out


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not got.isnan().any()
    assert torch.equal(got.isneginf(), want.isneginf())
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def expected(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    want = logits.clone()
    reference.apply_token_bitmask_(want, bitmask, rows)
    return want


def cpu_has_avx2() -> bool | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return " avx2" in f.read()
    except OSError:
        return None


@pytest.fixture
def triton_op() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    module = pytest.importorskip("pyserve_kernels.triton_ops.token_bitmask")
    return module.apply_token_bitmask_


# ---------------------------------------------------------------- reference


@pytest.mark.parametrize("case", CASES[:-1], ids=case_id)
def test_reference_matches_the_bitwise_definition(case) -> None:
    batch, vocab, rows = case
    logits, bitmask = make_logits(batch, vocab, seed=1), make_bitmask(len(rows), vocab, seed=2)
    want = bitwise(logits, bitmask, rows)
    got = logits.clone()
    reference.apply_token_bitmask_(got, bitmask, torch.tensor(rows, dtype=torch.int32))
    assert_bit_equal(got, want)
    untouched = [r for r in range(batch) if r not in rows]
    assert torch.equal(got[untouched].view(torch.int32), logits[untouched].view(torch.int32))


def test_each_kind_of_mask_word() -> None:
    # words: all allowed, none allowed, mixed (0x0F0F0F0F), and a last word past vocab 100
    # whose bits >= 100 are set and must not matter
    bitmask = torch.tensor([[-1, 0, 0x0F0F0F0F, 0b1010 | ~0xF]], dtype=torch.int32)
    logits = make_logits(2, 100, seed=3)
    want = logits.clone()
    want[1, 32:64] = NEG_INF
    mixed = torch.arange(64, 96)
    want[1, mixed[(mixed - 64) % 8 >= 4]] = NEG_INF
    want[1, [96, 98]] = NEG_INF
    rows = torch.tensor([1], dtype=torch.int32)
    assert_bit_equal(expected(logits, bitmask, rows), want)
    for simd in (True, False):
        got = logits.clone()
        _native._cpu.apply_token_bitmask(got.numpy(), bitmask.numpy(), rows.numpy(), 1, simd=simd)
        assert_bit_equal(got, want)


# ---------------------------------------------------------------- native CPU kernel


@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "forced-scalar"])
@pytest.mark.parametrize("case", [*CASES, (24, 12000, [23, 0, 5, 11, 7, 19, 2, 3, 16, 9])], ids=case_id)
def test_native_matches_reference(case, simd, num_threads) -> None:
    # the last case is enough work (K x vocab floats) to split over 2 threads
    batch, vocab, rows_list = case
    logits, bitmask = make_logits(batch, vocab, seed=4), make_bitmask(len(rows_list), vocab, seed=5)
    rows = torch.tensor(rows_list, dtype=torch.int32)
    got = logits.clone()
    path = _native._cpu.apply_token_bitmask(got.numpy(), bitmask.numpy(), rows.numpy(), num_threads, simd=simd)
    has_avx2 = cpu_has_avx2()
    if not simd:
        assert path == "scalar"
    elif has_avx2 is not None:
        assert path == ("avx2" if has_avx2 else "scalar")
    assert_bit_equal(got, expected(logits, bitmask, rows))


def test_public_op_on_cpu_masks_rows_of_a_padded_tensor_in_place() -> None:
    # The first vocab columns of a wider (padded) tensor: rows contiguous, row stride 160.
    batch, vocab = 6, 150
    padded = make_logits(batch, 160, seed=6)
    logits = padded[:, :vocab]
    assert not logits.is_contiguous()
    bitmask, rows = make_bitmask(3, vocab, seed=7), torch.tensor([4, 0, 5], dtype=torch.int32)
    want_padded = padded.clone()
    reference.apply_token_bitmask_(want_padded[:, :vocab], bitmask, rows)
    K.apply_token_bitmask_(logits, bitmask, rows)
    assert_bit_equal(padded, want_padded)  # the padding columns keep their bits too
    assert logits.data_ptr() == padded.data_ptr()


def test_public_op_with_no_masked_rows_changes_nothing() -> None:
    logits = make_logits(3, 70, seed=8)
    before = logits.clone()
    K.apply_token_bitmask_(logits, torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert_bit_equal(logits, before)


# ---------------------------------------------------------------- Triton kernel


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_matches_reference(case, triton_op) -> None:
    batch, vocab, rows_list = case
    logits, bitmask = make_logits(batch, vocab, seed=9), make_bitmask(len(rows_list), vocab, seed=10)
    rows = torch.tensor(rows_list, dtype=torch.int32)
    want = expected(logits, bitmask, rows)
    got = logits.to(DEVICE)
    assert triton_op(got, bitmask.to(DEVICE), rows.to(DEVICE)) is None
    assert_bit_equal(got.cpu(), want)


def test_triton_on_strided_rows_and_bitmask_and_many_word_blocks(triton_op) -> None:
    # 300 words: more than one program's 128-word block per row; the bitmask a column slice
    batch, vocab = 5, 9600
    padded = make_logits(batch, 9700, seed=11)
    wide_mask = make_bitmask(2, 9600 + 64, seed=12)
    bitmask, rows = wide_mask[:, :300], torch.tensor([3, 1], dtype=torch.int32)
    assert not bitmask.is_contiguous()
    want = padded.clone()
    reference.apply_token_bitmask_(want[:, :vocab], bitmask.contiguous(), rows)
    got = padded.to(DEVICE)
    triton_op(got[:, :vocab], bitmask.to(DEVICE), rows.to(DEVICE))
    assert_bit_equal(got.cpu(), want)


def test_triton_skips_rows_outside_the_batch(triton_op) -> None:
    # No host sync to check row values: a bad row is dropped, the good one still masked.
    logits, bitmask = make_logits(3, 64, seed=13), torch.zeros(2, 2, dtype=torch.int32)
    got = logits.to(DEVICE)
    triton_op(got, bitmask.to(DEVICE), torch.tensor([3, 1], dtype=torch.int32, device=DEVICE))
    want = logits.clone()
    want[1] = NEG_INF
    assert_bit_equal(got.cpu(), want)


# ---------------------------------------------------------------- errors


def _op(impl: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    return {"public": K.apply_token_bitmask_, "reference": reference.apply_token_bitmask_}[impl]


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _args(logits=None, bitmask=None, rows=None) -> Callable[[], tuple[torch.Tensor, ...]]:
    """Fresh (logits [2, 40], bitmask [1, 2], rows [1]) that fit, with the given ones swapped in."""
    return lambda: (
        logits() if logits else torch.zeros(2, 40),
        bitmask() if bitmask else torch.zeros(1, 2, dtype=torch.int32),
        rows() if rows else _i32(0),
    )


# name: (arguments, message); each rejected before anything is written
SHAPE_ERRORS = {
    "float16 logits": (
        _args(logits=lambda: torch.zeros(2, 40, dtype=torch.float16)),
        r"apply_token_bitmask_: logits must be torch.float32, got torch.float16",
    ),
    "int64 bitmask": (
        _args(bitmask=lambda: torch.zeros(1, 2, dtype=torch.int64)),
        r"apply_token_bitmask_: bitmask must be torch.int32, got torch.int64",
    ),
    "int64 rows": (
        _args(rows=lambda: torch.tensor([0])),
        r"apply_token_bitmask_: rows must be torch.int32, got torch.int64",
    ),
    "bitmask width": (
        _args(bitmask=lambda: torch.zeros(1, 1, dtype=torch.int32)),
        r"apply_token_bitmask_: logits \(2, 40\), bitmask \(1, 1\), rows \(1,\) do not fit",
    ),
    "rows length": (
        _args(rows=lambda: _i32(0, 1)),
        r"apply_token_bitmask_: logits \(2, 40\), bitmask \(1, 2\), rows \(2,\) do not fit",
    ),
    "1-D logits": (
        _args(logits=lambda: torch.zeros(40)),
        r"apply_token_bitmask_: logits \(40,\), bitmask \(1, 2\), rows \(1,\) do not fit",
    ),
    "device": (
        _args(bitmask=lambda: torch.zeros(1, 2, dtype=torch.int32, device="meta")),
        r"apply_token_bitmask_: tensors on different devices: logits cpu, bitmask meta, rows cpu",
    ),
    "strided columns": (
        _args(logits=lambda: torch.zeros(40, 2).t()),
        r"apply_token_bitmask_: each row of logits must be contiguous, got strides \(1, 2\)",
    ),
    "broadcast rows": (
        _args(logits=lambda: torch.zeros(1, 40).expand(2, 40)),
        r"apply_token_bitmask_: rows of logits overlap in memory, got strides \(0, 1\)",
    ),
}

ROW_ERRORS = {
    "row past the batch": (_i32(0, 2), r"apply_token_bitmask_: rows\[1\] = 2 is outside 0..2"),
    "negative row": (_i32(-1, 0), r"apply_token_bitmask_: rows\[0\] = -1 is outside 0..2"),
    "repeated row": (_i32(1, 1), r"apply_token_bitmask_: row 1 appears twice in rows"),
}


@pytest.mark.parametrize("impl", ["public", "reference", "triton"])
@pytest.mark.parametrize("name", list(SHAPE_ERRORS))
def test_argument_errors(name, impl, request) -> None:
    make_args, message = SHAPE_ERRORS[name]
    op = request.getfixturevalue("triton_op") if impl == "triton" else _op(impl)
    logits, bitmask, rows = make_args()
    with pytest.raises(ValueError, match=message):
        op(logits, bitmask, rows)
    assert not logits.isneginf().any()


def test_native_binding_rejects_what_the_python_checks_would() -> None:
    # The binding checks again (it is callable on its own): layouts numpy can express.
    mask, rows = torch.zeros(1, 2, dtype=torch.int32).numpy(), _i32(0).numpy()
    with pytest.raises(ValueError, match=r"apply_token_bitmask_: rows of logits overlap in memory"):
        _native._cpu.apply_token_bitmask(torch.zeros(1, 40).expand(2, 40).numpy(), mask, rows)
    with pytest.raises(ValueError, match=r"apply_token_bitmask_: each row of logits must be contiguous"):
        _native._cpu.apply_token_bitmask(torch.zeros(40, 2).t().numpy(), mask, rows)
    with pytest.raises(ValueError, match=r"logits \[2, 40\], bitmask \[1, 1\], rows \[1\] do not fit"):
        _native._cpu.apply_token_bitmask(torch.zeros(2, 40).numpy(), mask[:, :1], rows)
    with pytest.raises(ValueError, match=r"bitmask must be C-contiguous"):
        _native._cpu.apply_token_bitmask(
            torch.zeros(2, 40).numpy(), torch.zeros(2, 2, dtype=torch.int32).t().numpy(), _i32(0, 1).numpy()
        )


@pytest.mark.parametrize("impl", ["public", "reference"])
@pytest.mark.parametrize("name", list(ROW_ERRORS))
def test_row_errors_write_nothing(name, impl) -> None:
    rows, message = ROW_ERRORS[name]
    logits = make_logits(2, 40, seed=14)
    before = logits.clone()
    with pytest.raises(ValueError, match=message):
        _op(impl)(logits, torch.zeros(2, 2, dtype=torch.int32), rows)
    assert_bit_equal(logits, before)


# ---------------------------------------------------------------- against xgrammar


# A byte-level toy vocabulary of 45 tokens (not a multiple of 32) for the builtin JSON grammar.
TOY_VOCAB = [
    "<s>", "</s>", "{", "}", '"', "a", "b", ":", ",", " ", "[", "]", "1", "2", "true", "false", "null",
    "ab", '"a"', '{"', '":', "x", "y", "0", ".", "-", "e", "n", "u", "l", "t", "r", "f", "s", "\\",
    "}\n", "\n", "  ", '"b"', "12", "tru", "fal", "nul", "ba", ", ",
]  # fmt: skip
# Tokens accepted one by one: {"a": [12, true], "b": "ab"}
TOY_TEXT = ["{", '"a"', ":", " ", "[", "12", ",", " ", "true", "]", ",", '"b"', ":", '"', "ab", '"', "}"]


def xgrammar_masks() -> torch.Tensor:
    """The JSON grammar's bitmask before each token of TOY_TEXT, one row per step, as
    xgrammar's GrammarMatcher fills it."""
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo(TOY_VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=len(TOY_VOCAB), stop_token_ids=[1])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_builtin_json_grammar()
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(len(TOY_TEXT) + 1, info.vocab_size)
    for step, token in enumerate(TOY_TEXT):
        matcher.fill_next_token_bitmask(bitmask, step)
        assert matcher.accept_token(TOY_VOCAB.index(token)), token
    matcher.fill_next_token_bitmask(bitmask, len(TOY_TEXT))  # after "}": only the stop token
    return bitmask


def test_xgrammar_filled_mask_applies_as_xgrammars_own_apply() -> None:
    xgr = pytest.importorskip("xgrammar")
    bitmask = xgrammar_masks()
    assert bitmask.dtype == torch.int32 and bitmask.shape == (len(TOY_TEXT) + 1, 2)
    logits = make_logits(bitmask.shape[0], len(TOY_VOCAB), seed=15)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask)
    # the grammar really masks: the last step allows only the stop token
    assert want[-1].isfinite().nonzero().flatten().tolist() == [1]

    every_row = torch.arange(bitmask.shape[0], dtype=torch.int32)
    got = logits.clone()
    K.apply_token_bitmask_(got, bitmask, every_row)
    assert_bit_equal(got, want)

    # a subset of rows: xgrammar's `indices` read mask row i for logits row i; ours takes the
    # gathered mask rows and where they go
    indices = [0, 4, 9, len(TOY_TEXT)]
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=indices)
    for simd in (True, False):
        got = logits.clone()
        _native._cpu.apply_token_bitmask(
            got.numpy(), bitmask[indices].numpy(), torch.tensor(indices, dtype=torch.int32).numpy(), 1, simd=simd
        )
        assert_bit_equal(got, want)


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_public_op_matches_reference_and_xgrammar_and_captures_in_a_graph() -> None:
    xgr = pytest.importorskip("xgrammar")
    batch, vocab = 64, 49152 + 7
    logits, bitmask = make_logits(batch, vocab, seed=16), make_bitmask(40, vocab, seed=17)
    rows = torch.randperm(batch, generator=torch.Generator().manual_seed(18))[:40].to(torch.int32)
    want = expected(logits, bitmask, rows)
    got, mask_d, rows_d = logits.cuda(), bitmask.cuda(), rows.cuda()
    K.apply_token_bitmask_(got, mask_d, rows_d)
    assert_bit_equal(got.cpu(), want)

    full_mask = torch.full((batch, bitmask.shape[1]), -1, dtype=torch.int32)
    full_mask[rows.long()] = bitmask
    by_xgrammar = logits.cuda()
    xgr.apply_token_bitmask_inplace(by_xgrammar, full_mask.cuda(), indices=rows.tolist())
    assert_bit_equal(by_xgrammar.cpu(), want)

    # host-sync-free: capturable, and a replay masks what the static inputs hold then
    static = logits.cuda()
    K.apply_token_bitmask_(static, mask_d, rows_d)  # warm-up (compiles) outside the capture
    static.copy_(logits.cuda())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.apply_token_bitmask_(static, mask_d, rows_d)
    static.copy_(logits.cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert_bit_equal(static.cpu(), want)
