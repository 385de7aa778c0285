"""Calls as a JSON array of objects: `[{"name": "f", "parameters": {...}}, ...]`.

The shape of a forced tool call (`tool_choice` `required` or a named function: the grammar
makes the model write exactly such an array, so the reply always parses), and, after its
`[TOOL_CALLS]` marker, of Mistral's format (mistral.py). Objects take `arguments` or
`parameters`; an object without a name is skipped; text after the array is content.
"""

from __future__ import annotations

from pyserve.parsers.json_call import WHITESPACE, ScannedCall
from pyserve.parsers.tool_call_base import ToolCallParser, ToolEvent, held_marker_len

# states
_CONTENT, _OPEN, _ELEMENT, _CALL, _AFTER_ELEMENT = range(5)


class JsonArrayParser(ToolCallParser):
    """A JSON array of call objects, after `marker` (None: at the start of the reply, where
    anything else than `[` makes the whole reply content). One per reply; loop thread."""

    def __init__(self, marker: str | None = None) -> None:
        super().__init__()
        self.marker = marker
        self._state = _CONTENT if marker is not None else _OPEN
        self._bracketed = True  # the calls are in an array (Mistral may write one bare object)
        self._call: ScannedCall | None = None
        self._consumed = ""  # the array's text so far, while it has no call
        self._array_calls = 0  # calls started in the array (0 or 1: whether any)

    def _step(self, out: list[ToolEvent]) -> bool:
        """Consume what the buffer allows in the current state; False when it must wait."""
        buf, state = self._buf, self._state
        if state == _CONTENT:
            k = -1 if self.marker is None else buf.find(self.marker)
            if k < 0:
                keep = 0 if self.marker is None else held_marker_len(buf, self.marker)
                self.content.add(buf[: len(buf) - keep], out)
                self._buf = buf[len(buf) - keep :]
                return False
            self.content.add(buf[:k], out)
            self._buf, self._state, self._consumed, self._array_calls = buf[k:], _OPEN, "", 0
            self._take(len(self.marker or ""))
            return True
        if state == _CALL:
            call = self._call
            assert call is not None
            self._take(call.feed(buf, out))
            if call.started and self._array_calls == 0:
                self._array_calls, self._consumed = 1, ""
            if not call.ended:
                return False
            if call.scanner.failed or not self._bracketed:  # not JSON, or the one bare object: content follows
                self._fall_back(out)
            else:
                self._state = _AFTER_ELEMENT
            return True
        stripped = buf.lstrip(WHITESPACE)
        if not stripped:
            return False
        c = stripped[0]
        if state == _OPEN and c in "[{":
            self._bracketed = c == "["
            self._take(len(buf) - len(stripped) + self._bracketed)
            self._state = _ELEMENT if self._bracketed else _CALL
            self._call = None if self._bracketed else ScannedCall(self)
        elif state == _ELEMENT and c == "{":
            self._take(len(buf) - len(stripped))
            self._state, self._call = _CALL, ScannedCall(self)
        elif state == _AFTER_ELEMENT and c == ",":
            self._take(len(buf) - len(stripped) + 1)
            self._state = _ELEMENT
        elif c == "]" and state in (_ELEMENT, _AFTER_ELEMENT):
            self._take(len(buf) - len(stripped) + 1)
            self._state = _CONTENT
            if self._array_calls == 0:  # an array without calls: content after all
                self.content.add(self._consumed, out)
        else:  # not an array of calls: the rest is content
            self._fall_back(out)
        return True

    def _take(self, n: int) -> None:
        """Consume the buffer's first `n` characters (kept while the array has no call, to
        be content if it never gets one)."""
        if self._array_calls == 0:
            self._consumed += self._buf[:n]
        self._buf = self._buf[n:]

    def _fall_back(self, out: list[ToolEvent]) -> None:
        """What follows is content, and so is the array's text so far if it made no call."""
        if self._array_calls == 0:
            self.content.add(self._consumed, out)
        self._state = _CONTENT

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self._state != _CONTENT and self._array_calls == 0:
            self.content.add(self._consumed, out)  # (a call cut short keeps the arguments it had)
        self.content.add(self._buf, out)
        self._buf = ""
        self.content.finish(out)
        return out
