"""The Llama 3.1/3.2 JSON tool-call format (`--tool-call-parser llama3`): an optional
`<|python_tag|>`, then one or more JSON objects separated by `;`:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A reply that starts with `{` (after whitespace) is calls too, as Llama 3.2's template asks for
them without the tag. Objects take `parameters` (Meta's name) or `arguments`. Text before the
tag is content, and so is whatever follows the calls that is not another call.
`<|python_tag|>` is a special token: the routes keep special tokens in the text of requests
with tools parsed this way.
"""

from __future__ import annotations

from pyserve.parsers.json_call import WHITESPACE, ScannedCall
from pyserve.parsers.tool_call_base import ToolCallParser, ToolEvent, held_marker_len

TAG = "<|python_tag|>"

# states
_START, _CONTENT, _NEXT, _CALL, _AFTER_CALL = range(5)


class Llama3Parser(ToolCallParser):
    """`<|python_tag|>{...}; {...}` (see the module docstring). One per reply; loop thread."""

    def __init__(self) -> None:
        super().__init__()
        self._state = _START
        self._call: ScannedCall | None = None
        self._consumed = ""  # the text since the tag (or `;`), until a call comes of it

    def _step(self, out: list[ToolEvent]) -> bool:
        """Consume what the buffer allows in the current state; False when it must wait."""
        buf, state = self._buf, self._state
        if state == _CONTENT:
            k = buf.find(TAG)
            if k < 0:
                keep = held_marker_len(buf, TAG)
                self.content.add(buf[: len(buf) - keep], out)
                self._buf = buf[len(buf) - keep :]
                return False
            self.content.add(buf[:k], out)
            self._buf, self._state, self._consumed = buf[k + len(TAG) :], _NEXT, TAG
            return True
        if state == _CALL:
            call = self._call
            assert call is not None
            used = call.feed(buf, out)
            self._consumed += buf[:used]
            self._buf = buf[used:]
            if not call.ended:
                return False
            if call.started and not call.scanner.failed:
                self._state = _AFTER_CALL
            else:  # not a call (or not JSON): content
                self._fall_back(out)
            return True
        stripped = buf.lstrip(WHITESPACE)
        if not stripped:
            return False
        skipped = len(buf) - len(stripped)
        if state == _START:
            if stripped.startswith(TAG):
                self._buf, self._state, self._consumed = stripped[len(TAG) :], _NEXT, buf[: skipped + len(TAG)]
            elif TAG.startswith(stripped):
                return False  # may still become the tag
            else:  # calls right away (`{`), or content
                self._state = _NEXT if stripped[0] == "{" else _CONTENT
        elif state == _NEXT and stripped[0] == "{":
            self._state, self._call = _CALL, ScannedCall(self)
        elif state == _AFTER_CALL and stripped[0] == ";":
            self._buf, self._state, self._consumed, self._call = stripped[1:], _NEXT, buf[: skipped + 1], None
        elif state == _AFTER_CALL:  # text after the calls: content
            self._buf, self._state = stripped, _CONTENT
        else:
            self._fall_back(out)
        return True

    def _fall_back(self, out: list[ToolEvent]) -> None:
        """What follows is content; so is the text since the tag (or `;`) when no call came
        of it."""
        if self._call is None or not self._call.started:
            self.content.add(self._consumed, out)
        self._state, self._consumed, self._call = _CONTENT, "", None

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self._state in (_NEXT, _CALL):
            self._fall_back(out)  # (a call cut short keeps the arguments it had)
        if self._state != _AFTER_CALL:
            self.content.add(self._buf, out)
        self._buf = ""
        self.content.finish(out)
        return out
