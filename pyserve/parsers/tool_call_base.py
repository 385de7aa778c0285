"""What every tool-call parser shares: the events it emits, the base class, the whitespace rule
for content around calls, and the one-shot parse of a whole reply.

A parser is fed a reply's text piece by piece (`feed`, then `finish` once at the end) and emits
events in order: content text (`TextPiece`), the start of call k with its function name
(`CallStart`), then that call's arguments text (`CallArgs`, the JSON text of the arguments
object in pieces). Whatever the pieces, the events concatenate to the same result: a
non-streamed reply is `parse_all` of its text, a streamed one the same parser fed delta by
delta, so the two agree by construction.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TextPiece:
    """Content text (outside any call)."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """Call `index` (0, 1, ... in the reply) of the function `name` begins."""

    index: int
    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    """More of call `index`'s arguments: JSON text, to be concatenated."""

    index: int
    text: str


ToolEvent = TextPiece | CallStart | CallArgs


@dataclass
class ParsedCall:
    name: str
    arguments: str


@dataclass
class ParsedReply:
    """A whole reply split: `content` (the text outside the calls) and the calls in order."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def collect(events: list[ToolEvent], into: ParsedReply) -> ParsedReply:
    """Append `events` to `into` (content concatenated, arguments per call); returns it."""
    for ev in events:
        if isinstance(ev, TextPiece):
            into.content += ev.text
        elif isinstance(ev, CallStart):
            into.calls.append(ParsedCall(ev.name, ""))
        else:
            into.calls[ev.index].arguments += ev.text
    return into


class ContentText:
    """The whitespace rule of content next to calls, shared by every format: whitespace
    before a call, at the start of content that begins after a call, and at the end of a
    reply that made calls is dropped, so "Sure.\\n<call>" gives the content "Sure."; whitespace
    between two content parts is kept; a reply without calls keeps every character. Trailing
    whitespace is held back until more content shows whether it is kept. Loop thread."""

    def __init__(self) -> None:
        self.pending_ws = ""
        self.emitted = False
        self.calls_made = False

    def add(self, text: str, out: list[ToolEvent]) -> None:
        if not text:
            return
        body = text.rstrip()
        if not body:
            self.pending_ws += text
            return
        lead = self.pending_ws
        if self.calls_made and not self.emitted:  # content that begins after a call
            lead, body = "", body.lstrip()
        self.pending_ws = text[len(text.rstrip()) :]
        out.append(TextPiece(lead + body))
        self.emitted = True

    def call_starts(self) -> None:
        self.pending_ws = ""
        self.calls_made = True

    def finish(self, out: list[ToolEvent]) -> None:
        if self.pending_ws and not self.calls_made:
            out.append(TextPiece(self.pending_ws))
        self.pending_ws = ""


class ToolCallParser(abc.ABC):
    """Splits one reply into content and calls, incrementally (one instance per reply).

    `feed(text)` takes the next piece and returns the events it completes; `finish()` ends the
    reply and returns the rest (text held back because it might have begun a marker, a call
    cut short). Not thread-safe: one reply, one thread (the loop)."""

    def __init__(self) -> None:
        self.content = ContentText()
        self.num_calls = 0
        self._buf = ""  # text fed and not yet consumed by `_step`

    def feed(self, text: str) -> list[ToolEvent]:
        """Events completed by `text` (appended to the reply so far)."""
        out: list[ToolEvent] = []
        self._buf += text
        while self._buf:
            if not self._step(out):
                break
        return out

    @abc.abstractmethod
    def _step(self, out: list[ToolEvent]) -> bool:
        """Consume what the buffer allows in the parser's current state, appending events to
        `out`; False when it must wait for more text."""

    @abc.abstractmethod
    def finish(self) -> list[ToolEvent]:
        """Events of the text held back; call once, after the last `feed`."""

    def start_call(self, name: str, out: list[ToolEvent]) -> int:
        """Emit the start of the next call; returns its index."""
        self.content.call_starts()
        index = self.num_calls
        self.num_calls += 1
        out.append(CallStart(index, name))
        return index


def parse_all(parser: ToolCallParser, text: str) -> ParsedReply:
    """`text` (a whole reply) split by `parser` (a fresh one)."""
    reply = ParsedReply("")
    collect(parser.feed(text), reply)
    return collect(parser.finish(), reply)


def held_marker_len(text: str, marker: str) -> int:
    """Length of the longest proper suffix of `text` that is a prefix of `marker`: the text a
    streaming parser holds back because the next piece may complete the marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
