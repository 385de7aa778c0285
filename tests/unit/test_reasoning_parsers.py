"""Reasoning parsers (pyserve/parsers/reasoning_parser.py): `<think>...</think>` split exactly into
reasoning and content, whatever the pieces the text arrives in (markers cut across pieces)."""

from __future__ import annotations

import pytest

from pyserve.parsers import REASONING_PARSERS
from pyserve.parsers.registry import REASONING_STARTS_INSIDE, make_reasoning_parser

CHUNKS = (1, 3, 7, 10**9)


def split(name: str, text: str, size: int) -> tuple[str, str]:
    parser = make_reasoning_parser(name)
    reasoning = content = ""
    for k in range(0, len(text), size):
        r, c = parser.feed(text[k : k + size])
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


CASES = [
    # deepseek-r1: the reply starts inside the thinking, with or without <think>
    ("deepseek-r1", "Let me think.\nOK.\n</think>\n\nThe answer is 4.", "Let me think.\nOK.", "The answer is 4."),
    ("deepseek-r1", "<think>\nHm</think>4", "Hm", "4"),
    ("deepseek-r1", "Still thinking when cut", "Still thinking when cut", ""),
    ("deepseek-r1", "a </thin", "a </thin", ""),
    # qwen3: only an opening <think> starts it
    ("qwen3", "<think>\nx < y\n</think>\n\nAnswer </thi", "x < y", "Answer </thi"),
    ("qwen3", "  \n<think>r</think>", "r", ""),
    ("qwen3", " No thinking here <think>", "", " No thinking here <think>"),
    ("qwen3", "<thi", "", "<thi"),
    ("qwen3", "<think>\n\n</think>\n\n{}", "", "{}"),
]


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_split_exactly_in_every_chunking(name, text, reasoning, content):
    for size in CHUNKS:
        assert split(name, text, size) == (reasoning, content), size


def test_names():
    assert set(REASONING_STARTS_INSIDE) == set(REASONING_PARSERS) == {"deepseek-r1", "qwen3"}
    with pytest.raises(KeyError):
        make_reasoning_parser("nope")


def test_marker_cut_across_pieces_is_held_back():
    parser = make_reasoning_parser("qwen3")
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>abc</th") == ("abc", "")
    assert parser.in_reasoning
    assert parser.feed("ink>\nxyz") == ("", "xyz")
    assert not parser.in_reasoning
    assert parser.finish() == ("", "")
