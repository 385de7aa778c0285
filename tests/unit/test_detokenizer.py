"""Incremental detokenization: multi-byte characters never split, stop strings cut and held
back, chunks always concatenate to the final text."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pyserve.engine.detokenizer import Detokenizer
from pyserve.engine.scheduler import TokenOut


@pytest.fixture(scope="module")
def tokenizer(stories_path):
    return AutoTokenizer.from_pretrained(stories_path)


class Recorder:
    def __init__(self):
        self.outs, self.finished = [], []

    def deliver(self, out):
        self.outs.append(out)

    def finish(self, rid, reason):
        self.finished.append((rid, reason))


def run(tokenizer, ids, stop=(), finish_last=True):
    rec = Recorder()
    det = Detokenizer(tokenizer, rec.deliver, rec.finish)
    det.register("r", list(stop), skip_special_tokens=True)
    for i, t in enumerate(ids):
        last = finish_last and i == len(ids) - 1
        det.handle(TokenOut("r", [t], {"type": "length", "length": len(ids)} if last else None, 3, 0))
    return rec


def test_multibyte_characters_are_never_split(tokenizer):
    text = "Tom saw 日本 and a café ☃."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # byte fallback: several ids per CJK character
    rec = run(tokenizer, ids)
    deltas = [o.text_delta for o in rec.outs]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert rec.outs[-1].text == text
    assert rec.outs[-1].output_ids == ids


def test_stop_string_cuts_text_and_finishes(tokenizer):
    ids = tokenizer.encode("Lily went to the park. She played.", add_special_tokens=False)
    rec = run(tokenizer, ids, stop=["park"], finish_last=False)
    assert rec.finished == [("r", {"type": "stop", "matched": "park"})]
    assert rec.outs[-1].text == "Lily went to the "
    assert rec.outs[-1].finish_reason == {"type": "stop", "matched": "park"}
    assert "".join(o.text_delta for o in rec.outs) == "Lily went to the "
    # tokens after the stop are dropped
    n = len(rec.outs)
    assert all(o.finish_reason is None for o in rec.outs[:-1]) and n == len(rec.outs)


def test_partial_stop_string_is_held_back_then_released(tokenizer):
    ids = tokenizer.encode("the park is big", add_special_tokens=False)
    rec = run(tokenizer, ids, stop=["park bench"])
    assert rec.finished == []
    sent = ""
    for o in rec.outs[:-1]:
        sent += o.text_delta
        assert not sent.endswith(("p", "pa", "par", "park", "park "))
    assert "".join(o.text_delta for o in rec.outs) == "the park is big"
    assert rec.outs[-1].finish_reason == {"type": "length", "length": len(ids)}
