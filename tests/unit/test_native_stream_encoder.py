"""The native stream's incremental encoder: every event's bytes equal encoding the whole
cumulative chunk (`sse_event(out.to_native())`), for text that needs JSON escapes, a stop string
cut, and chunks that add no ids; the IdsPrefix view it is fed."""

from __future__ import annotations

import orjson
import pytest

from pyserve.forward_batch_info import FinishReason
from pyserve.io_struct import GenerateOutput, IdsPrefix
from pyserve.server.render import NativeStreamEncoder, sse_event


def _outputs(deltas: list[tuple[str, list[int]]], final_text: str | None = None) -> list[GenerateOutput]:
    """Chunks as the detokenizer makes them: text and ids cumulative, ids as a view of one list."""
    ids: list[int] = []
    text = ""
    outs = []
    for k, (delta, new_ids) in enumerate(deltas):
        last = k == len(deltas) - 1
        ids.extend(new_ids)
        text += delta
        if last and final_text is not None:
            text = final_text
        outs.append(
            GenerateOutput(
                rid="r-1",
                text=text,
                text_delta=delta,
                output_ids=IdsPrefix(ids),
                ids_delta=list(new_ids),
                prompt_tokens=7,
                cached_tokens=3,
                finish_reason=FinishReason.length_limit(len(ids)) if last else None,
            )
        )
    return outs


CASES = {
    "plain": [("Once", [10]), (" upon", [11]), (" a", [12]), (" time", [13])],
    "escapes": [('say "hi"', [1, 2]), ("\\n\n\t", [3]), ("\x00\x1f", [4]), ("", [5]), ("日本 ☃ café", [6, 7, 8])],
    "surrogate": [("a", [1]), ("\udcff", [2]), ("b", [3])],
    "empty first": [("", [9]), ("", [8]), ("x", [7])],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_events_equal_the_whole_encoding(name: str) -> None:
    encode = NativeStreamEncoder()
    outs = _outputs(CASES[name])
    events = [encode(o) for o in outs]
    assert events == [sse_event(o.to_native()) for o in outs]
    last = orjson.loads(events[-1][len(b"data: ") :]) if name != "surrogate" else None
    if last is not None:
        assert last["text"] == "".join(d for d, _ in CASES[name])
        assert last["output_ids"] == [i for _, ids in CASES[name] for i in ids]
        assert last["meta_info"] == {
            "id": "r-1",
            "finish_reason": {"type": "length", "length": len(last["output_ids"])},
            "prompt_tokens": 7,
            "completion_tokens": len(last["output_ids"]),
            "cached_tokens": 3,
        }


def test_a_text_cut_at_the_end_is_encoded_whole() -> None:
    # a stop string found in the flushed tail cuts the text below what was sent
    encode = NativeStreamEncoder()
    outs = _outputs([("abc", [1]), ("def", [2]), ("", [3])], final_text="ab")
    events = [encode(o) for o in outs]
    assert events == [sse_event(o.to_native()) for o in outs]
    assert orjson.loads(events[-1][6:])["text"] == "ab"


def test_logprob_chunks_are_encoded_whole() -> None:
    encode = NativeStreamEncoder()
    out = _outputs([("a", [1])])[0]
    out.logprobs = {"output_token_logprobs": [[-0.5, 1, None]]}
    assert encode(out) == sse_event(out.to_native())
    assert orjson.loads(encode(out)[6:])["meta_info"]["output_token_logprobs"] == [[-0.5, 1, None]]


def test_ids_prefix_is_a_stable_view() -> None:
    ids = [5, 6, 7]
    view = IdsPrefix(ids)
    ids.extend([8, 9])
    assert len(view) == 3 and view == [5, 6, 7] and list(view) == [5, 6, 7] and view != [5, 6, 7, 8]
    assert view[0] == 5 and view[-1] == 7 and view[1:] == [6, 7] and view[::-1] == [7, 6, 5]
    with pytest.raises(IndexError):
        view[3]
    with pytest.raises(IndexError):
        view[-4]
    assert IdsPrefix(ids) == (5, 6, 7, 8, 9) and repr(view) == "[5, 6, 7]"
    assert (view == "567") is False
