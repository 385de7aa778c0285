"""The Qwen 2.5 / Hermes tool-call format (`--tool-call-parser qwen25`, aliases `hermes`, `qwen`).

Each call is a JSON object between tags, anywhere in the reply:

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content. A block whose object has no name (or is not JSON) is left
in the content as it was written. The format is the one Qwen 2.5's and Hermes 2 Pro's chat
templates teach; the parsing here is pyserve's own.
"""

from __future__ import annotations

from pyserve.parsers.json_call import ScannedCall
from pyserve.parsers.tool_call_base import ToolCallParser, ToolEvent, held_marker_len

START = "<tool_call>"
END = "</tool_call>"


class Qwen25Parser(ToolCallParser):
    """`<tool_call>{...}</tool_call>` blocks (see the module docstring). One per reply; loop
    thread."""

    def __init__(self) -> None:
        super().__init__()
        self._call: ScannedCall | None = None  # inside a block: its call
        self._block = ""  # the block's text after START, kept in case it is not a call
        self._tail = False  # after the block's object, looking for END

    def _step(self, out: list[ToolEvent]) -> bool:
        """Consume what the buffer allows in the current state; False when it must wait."""
        buf, call = self._buf, self._call
        if call is None:  # content
            k = buf.find(START)
            if k < 0:
                keep = held_marker_len(buf, START)
                self.content.add(buf[: len(buf) - keep], out)
                self._buf = buf[len(buf) - keep :]
                return False
            self.content.add(buf[:k], out)
            self._buf = buf[k + len(START) :]
            self._call, self._block, self._tail = ScannedCall(self), "", False
            return True
        if not self._tail:
            used = call.feed(buf, out)
            self._block += buf[:used]
            self._buf = buf[used:]
            self._tail = call.ended
            return self._tail
        k = buf.find(END)
        if k < 0:
            keep = held_marker_len(buf, END)
            self._block += buf[: len(buf) - keep]
            self._buf = buf[len(buf) - keep :]
            return False
        self._block += buf[:k]
        self._buf = buf[k + len(END) :]
        if not call.started:  # not a call: the block stays in the content, as written
            self.content.add(START + self._block + END, out)
        self._call = None
        return True

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self._call is None:
            self.content.add(self._buf, out)
        elif not self._call.started:
            self.content.add(START + self._block + self._buf, out)
        # (a call cut short keeps the arguments it had)
        self._buf = ""
        self.content.finish(out)
        return out
