"""One JSON function call, `{"name": "f", "arguments": {...}}`, read as its text arrives.

`CallObjectScanner` walks the object character by character (strings, escapes and nesting
tracked, nothing parsed twice): it finds the function's name and the text of its arguments
value, which it exposes as it grows, so a streamed call's arguments go out as the model writes
them. The arguments are the model's own JSON text (an object's text verbatim; a JSON string
holding JSON is decoded to that text, as some models write it). `ScannedCall` turns a scanner's
progress into the parser events of one call. Used by the qwen25, llama3, mistral and forced
(JSON array) formats.
"""

from __future__ import annotations

import json

from pyserve.parsers.tool_call_base import CallArgs, ToolCallParser, ToolEvent

WHITESPACE = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")

# scanner states
_START, _KEY_OR_END, _KEY, _COLON, _VALUE_START, _VALUE, _AFTER_VALUE = range(7)
# kinds of value
_STRING, _CONTAINER, _SCALAR = range(3)


class CallObjectScanner:
    """Reads one JSON object naming a call, as pieces of text arrive (`feed`).

    name: the function name once its string ended (None before; the call is not a call if
        the object ends without one). args_ready: the arguments text known so far (grows
        while an object or array value is read; a string or scalar value appears whole when
        it ends; "{}" when the object ended without arguments). done: the object's closing
        brace was read. failed: the text is not such an object (the character that showed it
        was not consumed). raw: every character consumed so far.
    """

    def __init__(self, arg_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
        self.arg_keys = arg_keys
        self.name: str | None = None
        self.args_ready = ""
        self.done = False
        self.failed = False
        self.raw = ""
        self._state = _START
        self._token: list[str] = []  # the key or value being read
        self._key = ""
        self._target = ""  # what the value being read is: "name", "args" or "" (skipped)
        self._args_seen = False
        self._kind = _SCALAR
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int:
        """Consume `text` up to the end of the object (or the first character that cannot
        belong to it); returns how many characters were consumed."""
        i, n = 0, len(text)
        args: list[str] = []  # container arguments text consumed by this call
        while i < n and not (self.done or self.failed):
            c = text[i]
            state = self._state
            if state == _VALUE:
                if not self._value_char(c, args):
                    continue  # a scalar ended at c: read c again after the value
            elif state == _KEY:
                self._string_char(c)
            elif c not in WHITESPACE:  # (whitespace between tokens changes nothing)
                self._structural_char(state, c, args)
                if self.failed:
                    break
            i += 1
        if args:
            self.args_ready += "".join(args)
        self.raw += text[:i]
        return i

    # ---- per-character steps -------------------------------------------------------------------
    def _string_char(self, c: str) -> None:
        """A character of a key (state _KEY)."""
        if self._escaped:
            self._escaped = False
        elif c == "\\":
            self._escaped = True
        elif c == '"':
            try:
                self._key = json.loads('"' + "".join(self._token) + '"')
            except ValueError:
                self._key = ""
            self._state = _COLON
            return
        self._token.append(c)

    def _begin_value(self, c: str, args: list[str]) -> None:
        key = self._key
        if key == "name":
            self._target = "name"
        elif key in self.arg_keys and not self._args_seen:
            self._target, self._args_seen = "args", True
        else:
            self._target = ""
        self._token = [c]
        self._state = _VALUE
        self._in_string = self._escaped = False
        if c == '"':
            self._kind, self._in_string = _STRING, True
        elif c in "{[":
            self._kind, self._depth = _CONTAINER, 1
            if self._target == "args":
                args.append(c)
        elif c in "-0123456789tfn":
            self._kind = _SCALAR
        else:
            self.failed = True

    def _structural_char(self, state: int, c: str, args: list[str]) -> None:
        """Outside keys and values: `{`, a key's quote, `:`, `,`, `}` or a value's first
        character, by state; anything else sets `failed`."""
        if state == _START:
            if c == "{":
                self._state = _KEY_OR_END
            else:
                self.failed = True
        elif state == _KEY_OR_END:
            if c == '"':
                self._state, self._token = _KEY, []
            elif c == "}":
                self._end_object()
            else:
                self.failed = True
        elif state == _COLON:
            if c == ":":
                self._state = _VALUE_START
            else:
                self.failed = True
        elif state == _VALUE_START:
            self._begin_value(c, args)
        elif state == _AFTER_VALUE:
            if c == ",":
                self._state = _KEY_OR_END
            elif c == "}":
                self._end_object()
            else:
                self.failed = True

    def _value_char(self, c: str, args: list[str]) -> bool:
        """A character of a value (state _VALUE); False when a scalar ended before `c`."""
        kind = self._kind
        if kind == _SCALAR and (c in ",}]" or c in WHITESPACE):
            self._end_value()
            return False
        self._token.append(c)
        if kind == _CONTAINER and self._target == "args":
            args.append(c)
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if kind == _STRING:
                    self._end_value()
        elif kind == _CONTAINER:
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end_value()
        return True

    def _end_value(self) -> None:
        self._state = _AFTER_VALUE
        text = "".join(self._token)
        if self._target == "name":
            try:
                name = json.loads(text) if self._kind == _STRING else None
            except ValueError:
                name = None
            if isinstance(name, str) and name and self.name is None:
                self.name = name
            elif self.name is None:
                self.failed = True
        elif self._target == "args" and self._kind != _CONTAINER:
            self.args_ready = _scalar_arguments(text, self._kind == _STRING)

    def _end_object(self) -> None:
        self.done = True
        if not self._args_seen:
            self.args_ready = "{}"


def _scalar_arguments(text: str, is_string: bool) -> str:
    """The arguments text of a string or scalar `arguments` value: a string is the JSON its
    content holds (some models quote the arguments object), null means no arguments."""
    if is_string:
        try:
            value = json.loads(text)
        except ValueError:
            return text
        return value if isinstance(value, str) else text
    return "{}" if text == "null" else text


class ScannedCall:
    """One call read by a CallObjectScanner, emitting its events through `parser`: the call
    starts once its name is known (arguments read before that wait), then its arguments
    text as it grows."""

    def __init__(self, parser: ToolCallParser, arg_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
        self.parser = parser
        self.scanner = CallObjectScanner(arg_keys)
        self.index: int | None = None
        self._sent = 0

    @property
    def started(self) -> bool:
        return self.index is not None

    @property
    def ended(self) -> bool:
        """The object ended, or turned out not to be one."""
        return self.scanner.done or self.scanner.failed

    def feed(self, text: str, out: list[ToolEvent]) -> int:
        """Consume what of `text` belongs to the object (see CallObjectScanner.feed),
        appending the events it completes to `out`; returns the characters consumed."""
        used = self.scanner.feed(text)
        scanner = self.scanner
        if self.index is None and scanner.name is not None:
            self.index = self.parser.start_call(scanner.name, out)
        if self.index is not None and len(scanner.args_ready) > self._sent:
            out.append(CallArgs(self.index, scanner.args_ready[self._sent :]))
            self._sent = len(scanner.args_ready)
        return used
