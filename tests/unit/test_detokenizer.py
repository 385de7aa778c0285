"""Incremental detokenization: multi-byte characters never split, stop strings cut and held
back, chunks always concatenate to the final text."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pyserve.engine.detokenizer import Detokenizer
from pyserve.forward_batch_info import FinishReason, TokenOut


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
        det.handle(TokenOut("r", [t], FinishReason.length_limit(len(ids)) if last else None, 3, 0))
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
    assert rec.finished == [("r", FinishReason.stop("park"))]
    assert rec.outs[-1].text == "Lily went to the "
    assert rec.outs[-1].finish_reason == FinishReason.stop("park")
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
    assert rec.outs[-1].finish_reason == FinishReason.length_limit(len(ids))


def run_with_prompt(tokenizer, prompt_ids, ids, stop=(), no_stop_trim=False, finish=None):
    rec = Recorder()
    det = Detokenizer(tokenizer, rec.deliver, rec.finish)
    det.register("r", list(stop), skip_special_tokens=True, prompt_ids=prompt_ids, no_stop_trim=no_stop_trim)
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        det.handle(TokenOut("r", [t], (finish or FinishReason.length_limit(len(ids))) if last else None, 3, 0))
    return rec


def continuation(tokenizer, prompt_ids, ids):
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    return tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)[len(prompt) :]


@pytest.mark.parametrize(
    "prompt,output",
    [
        ("Once upon a time,", " there was a little girl"),
        ("Once upon a", " time"),
        ("Tom saw", " 日本 and a café"),
        ("She said", ' "hi" and left.'),
        ("A long prompt with many words in it so the context is only its tail:", " yes"),
    ],
)
def test_first_token_keeps_its_word_initial_space(tokenizer, prompt, output):
    """SentencePiece drops the space of a decode's first token: decoding the output after a
    few prompt tokens keeps it, so text == decode(prompt + out) - decode(prompt)."""
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(prompt + output)[len(prompt_ids) :]
    assert tokenizer.decode(ids[:1]) != continuation(tokenizer, prompt_ids, ids[:1])  # the bug this fixes
    rec = run_with_prompt(tokenizer, prompt_ids, ids)
    want = continuation(tokenizer, prompt_ids, ids)
    assert rec.outs[-1].text == want
    assert "".join(o.text_delta for o in rec.outs) == want
    assert rec.outs[-1].output_ids == ids


def test_matched_stop_token_text_is_trimmed_unless_no_stop_trim(tokenizer):
    prompt_ids = tokenizer.encode("Lily went")
    ids = tokenizer.encode("Lily went to the park", add_special_tokens=True)[len(prompt_ids) :]
    stop = FinishReason.stop(ids[-1])
    trimmed = run_with_prompt(tokenizer, prompt_ids, ids, finish=stop)
    assert trimmed.outs[-1].text == continuation(tokenizer, prompt_ids, ids[:-1])
    assert trimmed.outs[-1].output_ids == ids  # the id itself is still reported
    kept = run_with_prompt(tokenizer, prompt_ids, ids, finish=stop, no_stop_trim=True)
    assert kept.outs[-1].text == continuation(tokenizer, prompt_ids, ids) == " to the park"


def test_no_stop_trim_keeps_the_stop_string(tokenizer):
    prompt_ids = tokenizer.encode("Lily")
    ids = tokenizer.encode("Lily went to the park. She played.")[len(prompt_ids) :]
    rec = run_with_prompt(tokenizer, prompt_ids, ids, stop=["park"], no_stop_trim=True)
    assert rec.finished == [("r", FinishReason.stop("park"))]
    assert rec.outs[-1].text == " went to the park"
    assert "".join(o.text_delta for o in rec.outs) == " went to the park"
