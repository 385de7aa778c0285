"""The detokenizer's DecodeStream path against its batched path: the same chunks, token for
token, for random output ids (multi-byte characters split over byte tokens included), for a
SentencePiece tokenizer (stories260k) and a byte-level BPE one (SmolLM2's kind, trained here),
with 1-3 tokens per step; a stream that refuses a step hands its request to the batched path."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pyserve.engine.detokenizer import Detokenizer
from pyserve.forward_batch_info import FinishReason, TokenOut

TEXT = (
    'Once upon a time, Tom saw 日本 and a café ☃ by the sea. "Hi!" said Lily.\n'
    "They ran, jumped and laughed: ünïcödé, emoji 🙂, tabs\tand  spaces. "
) * 20


@pytest.fixture(scope="module")
def stories_tokenizer(stories_path):
    return AutoTokenizer.from_pretrained(stories_path)


@pytest.fixture(scope="module")
def byte_level_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [TEXT],
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


class Recorder:
    def __init__(self):
        self.outs = []

    def deliver(self, out):
        self.outs.append(out)


def run(tokenizer, prompt, steps, use_stream, stop=()):
    rec = Recorder()
    det = Detokenizer(tokenizer, rec.deliver, lambda rid, reason: None)
    if not use_stream:
        det._stream_backend = None
    det.register("r", list(stop), skip_special_tokens=True, prompt_ids=prompt)
    state = det.states["r"]
    total = sum(len(s) for s in steps)
    for k, ids in enumerate(steps):
        last = k == len(steps) - 1
        det.handle(TokenOut("r", list(ids), FinishReason.length_limit(total) if last else None, len(prompt), 0))
    return [o.text_delta for o in rec.outs], state


def random_steps(rng, vocab, n):
    ids = [rng.randrange(vocab) for _ in range(n)]
    steps, k = [], 0
    while k < len(ids):
        m = rng.choice((1, 1, 1, 2, 3))
        steps.append(ids[k : k + m])
        k += m
    return ids, steps


@pytest.mark.parametrize("which", ["stories", "byte_level"])
@pytest.mark.parametrize("seed", range(6))
def test_stream_chunks_equal_the_batched_chunks(request, which, seed):
    tok = request.getfixturevalue(f"{which}_tokenizer")
    rng = random.Random(seed)
    real = tok.encode(TEXT, add_special_tokens=False)
    # half the cases continue real text (words, multi-byte characters), half are random ids
    start = rng.randrange(len(real) - 120)
    if seed % 2:
        ids, steps = random_steps(rng, len(tok), 80)
    else:
        ids = real[start + 8 : start + 88]
        _, shape = random_steps(rng, 2, 80)
        steps, k = [], 0
        for s in shape:
            steps.append(ids[k : k + len(s)])
            k += len(s)
    prompt = real[start : start + 8]
    cut = tok.decode(prompt[-5:], skip_special_tokens=True).endswith("\ufffd")  # inside a character
    streamed, state = run(tok, prompt, steps, use_stream=True)
    batched, _ = run(tok, prompt, steps, use_stream=False)
    assert streamed == batched
    if cut:
        assert state.decode_stream is False
    elif not seed % 2:  # real text stays on the stream path (random ids may make it refuse)
        assert state.decode_stream not in (None, False)
    if not seed % 2 and not cut:  # real text: the chunks are the text the output adds
        full = tok.decode(prompt + ids, skip_special_tokens=True)
        head = tok.decode(prompt, skip_special_tokens=True)
        assert "".join(streamed) == full[len(head) :]


def test_a_context_ending_inside_a_character_goes_the_batched_way(stories_tokenizer):
    tok = stories_tokenizer
    ids = tok.encode("Tom saw 日本 and a dog.", add_special_tokens=False)
    split = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    prompt, out = ids[:split], ids[split:]
    rec = Recorder()
    det = Detokenizer(tok, rec.deliver, lambda rid, reason: None)
    det.register("r", [], skip_special_tokens=True, prompt_ids=prompt)
    det.handle(TokenOut("r", [out[0]], None, len(prompt), 0))
    assert det.states["r"].decode_stream is False
    batched, _ = run(tok, prompt, [[t] for t in out], use_stream=False)
    streamed, _ = run(tok, prompt, [[t] for t in out], use_stream=True)
    assert streamed == batched and not any("saw" in d for d in streamed)


def test_stop_strings_the_same_on_both_paths(stories_tokenizer):
    tok = stories_tokenizer
    ids = tok.encode("Tom saw a big dog. The dog ran to the park.", add_special_tokens=False)
    steps = [[t] for t in ids]
    streamed, _ = run(tok, [], steps, use_stream=True, stop=["the park"])
    batched, _ = run(tok, [], steps, use_stream=False, stop=["the park"])
    assert streamed == batched and "".join(streamed) == "Tom saw a big dog. The dog ran to "


class RefusingStream:
    def step(self, tokenizer, ids):
        raise Exception("InvalidPrefix")


def test_a_refusing_stream_hands_over_to_the_batched_path(stories_tokenizer):
    tok = stories_tokenizer
    ids = tok.encode("Lily and Tom played in the sun all day.", add_special_tokens=False)
    rec = Recorder()
    det = Detokenizer(tok, rec.deliver, lambda rid, reason: None)
    det.register("r", [], skip_special_tokens=True)
    for k, t in enumerate(ids):
        if k == 3:
            det.states["r"].decode_stream = RefusingStream()
        last = k == len(ids) - 1
        det.handle(TokenOut("r", [t], FinishReason.length_limit(len(ids)) if last else None, 0, 0))
        if k == 3:
            assert det.states["r"].decode_stream is False
    assert "".join(o.text_delta for o in rec.outs) == tok.decode(ids, skip_special_tokens=True)
    assert len(rec.outs) == len(ids)
