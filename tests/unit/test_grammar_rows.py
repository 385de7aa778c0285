"""GrammarRows (worker side), on each grammar backend: each grammar row's mask is its matcher's
after the row's output so far, taken by request row; rows without a grammar are never masked;
resume, release and deferred (CUDA-style) ids each keep the matcher in step with its request;
rows of both backends share a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from pyserve.constrained import GrammarKey, JsonWhitespace, serving_grammar_backend
from pyserve.forward_batch_info import SamplingBatchInfo, SamplingRow
from pyserve.model_executor.grammar_rows import GrammarRows
from pyserve.sampling_params import SamplingParams

VOCAB = 512
EOS = 2


class _Compiler:
    """One backend's grammars by kind (compiled on the calling thread's behalf)."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def _get(self, kind: str, text: str):
        return self.backend.compile(GrammarKey(kind, text)).result(timeout=60)

    def compile_regex(self, text: str):
        return self._get("regex", text)

    def compile_grammar(self, text: str):
        return self._get("ebnf", text)


@pytest.fixture(scope="module")
def tokenizer(stories_path):
    return AutoTokenizer.from_pretrained(stories_path)


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def compiler(request, tokenizer):
    backend = serving_grammar_backend(request.param, tokenizer, VOCAB, [EOS], JsonWhitespace())
    yield _Compiler(backend), tokenizer
    backend.shutdown()


def _info(batch: int) -> SamplingBatchInfo:
    zeros = torch.zeros(batch)
    return SamplingBatchInfo(temperatures=zeros, top_ps=zeros + 1, top_ks=torch.zeros(batch, dtype=torch.int64))


def _expected_mask(compiled, tokens: list[int]) -> torch.Tensor:
    matcher = compiled.new_matcher()
    for t in tokens:
        assert matcher.accept_token(t)
    mask = torch.zeros((1, (VOCAB + 31) // 32), dtype=torch.int32)
    matcher.fill_next_token_bitmask(mask, 0)
    return mask[0]


def _row(idx: int, compiled, output_ids=None) -> SamplingRow:
    out = None if output_ids is None else np.asarray(output_ids, dtype=np.int32)
    return SamplingRow(idx, SamplingParams(), frozenset({EOS}), output_ids=out, grammar=compiled)


def _allowed(mask: torch.Tensor) -> list[int]:
    return [t for t in range(VOCAB) if (int(mask[t >> 5]) >> (t & 31)) & 1]


def test_masks_follow_each_rows_output(compiler):
    comp, tok = compiler
    digits = comp.compile_regex("[0-9]+x")
    rows = GrammarRows(8, VOCAB, "cpu")
    rows.set_rows([_row(3, digits), SamplingRow(5, SamplingParams(), frozenset())])
    assert rows.num_live == 1
    batch = np.array([5, 3], dtype=np.int32)
    info = _info(2)
    rows.prepare(info, batch)
    assert info.grammar_rows.tolist() == [1]  # only the grammar row, at its batch position
    assert torch.equal(info.grammar_bitmask[0], _expected_mask(digits, []))
    one = _allowed(info.grammar_bitmask[0])[0]
    rows.record(np.array([77, one], dtype=np.int32))  # row 5's token goes nowhere
    info = _info(2)
    rows.prepare(info, batch)
    assert torch.equal(info.grammar_bitmask[0], _expected_mask(digits, [one]))


def test_a_batch_without_grammar_rows_gets_no_mask(compiler):
    comp, _ = compiler
    rows = GrammarRows(8, VOCAB, "cpu")
    rows.set_rows([_row(1, comp.compile_regex("a+"))])
    info = _info(2)
    rows.prepare(info, np.array([0, 2], dtype=np.int32))
    assert info.grammar_bitmask is None and info.grammar_rows is None


def test_rows_of_both_backends_share_a_batch(tokenizer):
    backends = [
        serving_grammar_backend(n, tokenizer, VOCAB, [EOS], JsonWhitespace()) for n in ("xgrammar", "llguidance")
    ]
    try:
        digits, letters = (
            b.compile(GrammarKey("regex", text)).result(timeout=60) for b, text in zip(backends, ("[0-9]+x", "[a-c]+"))
        )
        rows = GrammarRows(4, VOCAB, "cpu")
        rows.set_rows([_row(0, digits), _row(2, letters)])
        batch = np.array([2, 1, 0], dtype=np.int32)
        info = _info(3)
        rows.prepare(info, batch)
        assert info.grammar_rows.tolist() == [0, 2]
        assert torch.equal(info.grammar_bitmask[0], _expected_mask(letters, []))
        assert torch.equal(info.grammar_bitmask[1], _expected_mask(digits, []))
        a, one = _allowed(info.grammar_bitmask[0])[0], _allowed(info.grammar_bitmask[1])[0]
        rows.record(np.array([a, 99, one], dtype=np.int32))
        info = _info(3)
        rows.prepare(info, batch)
        assert torch.equal(info.grammar_bitmask[0], _expected_mask(letters, [a]))
        assert torch.equal(info.grammar_bitmask[1], _expected_mask(digits, [one]))
    finally:
        for b in backends:
            b.shutdown()


def test_a_resumed_request_replays_its_output(compiler):
    comp, _ = compiler
    digits = comp.compile_regex("[0-9]+x")
    fresh = GrammarRows(4, VOCAB, "cpu")
    fresh.set_rows([_row(2, digits)])
    info = _info(1)
    fresh.prepare(info, np.array([2], dtype=np.int32))
    first = _allowed(info.grammar_bitmask[0])[0]
    resumed = GrammarRows(4, VOCAB, "cpu")
    resumed.set_rows([_row(2, digits, output_ids=[first])])
    info = _info(1)
    resumed.prepare(info, np.array([2], dtype=np.int32))
    assert torch.equal(info.grammar_bitmask[0], _expected_mask(digits, [first]))


def test_deferred_ids_go_to_the_request_that_sampled_them(compiler):
    comp, _ = compiler
    digits = comp.compile_regex("[0-9]+x")
    rows = GrammarRows(4, VOCAB, "cpu")
    rows.set_rows([_row(1, digits)])
    info = _info(1)
    rows.prepare(info, np.array([1], dtype=np.int32))
    token = _allowed(info.grammar_bitmask[0])[0]
    waited = []
    rows.record(np.array([token], dtype=np.int32), wait=lambda: waited.append(True))
    assert waited == []  # taken at the next prepare, not now
    rows.release_rows([1])  # the request left; a new one takes row 1 before the ids land
    rows.set_rows([_row(1, digits)])
    info = _info(1)
    rows.prepare(info, np.array([1], dtype=np.int32))
    assert waited == [True]
    assert torch.equal(info.grammar_bitmask[0], _expected_mask(digits, []))


def test_an_ended_grammar_masks_nothing_more_and_release_frees_the_row(compiler):
    comp, _ = compiler
    yes = comp.compile_grammar('root ::= "a"')
    rows = GrammarRows(4, VOCAB, "cpu")
    rows.set_rows([_row(0, yes)])
    batch = np.array([0], dtype=np.int32)
    info = _info(1)
    rows.prepare(info, batch)
    a = _allowed(info.grammar_bitmask[0])[0]  # ("a" as a piece, or as its byte token)
    rows.record(np.array([a], dtype=np.int32))
    info = _info(1)
    rows.prepare(info, batch)
    assert _allowed(info.grammar_bitmask[0]) == [EOS]  # only the stop token is left
    rows.record(np.array([EOS], dtype=np.int32))
    info = _info(1)
    rows.prepare(info, batch)
    assert info.grammar_bitmask is None
    rows.release_rows([0])
    assert rows.num_live == 0 and not rows.has_grammar.any()
