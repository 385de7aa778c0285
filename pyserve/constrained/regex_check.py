"""The regular-expression construct xgrammar (0.2.9) compiles wrongly inside a JSON schema's
`pattern`: an optional group (`(...)?` or `(...){0,1}`, not at the start) that holds a repeat
(`*`, `+`, `{m,n}` with n > 1). Its converter hoists the repeat out of the group, so
`^x(-a(\\.a)*)?$` accepts `x.a` and `^x(ab*)?$` accepts `xb` (tests/unit/test_regex_check.py
shows each case on xgrammar's own matcher). A schema with such a pattern is refused on the
xgrammar backend; llguidance compiles it correctly. xgrammar's own `regex` kind is not
affected (the same patterns are exact there).

The scan reads ECMA-262 / Python syntax by hand (escapes, character classes, groups and their
quantifiers) rather than with a regex parser, so a pattern Python cannot parse is still read.
"""

from __future__ import annotations


def optional_group_with_repeat(pattern: str) -> str | None:
    """The first optional group of `pattern` that holds a repeat, as it is written, or None."""
    # groups open but not closed: (start index, holds a repeat)
    stack: list[list[int | bool]] = []
    i, n = 0, len(pattern)
    last_atom_end = 0  # where the pattern read so far has text (an optional group there is leading)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            last_atom_end = i
            continue
        if c == "[":
            i = _class_end(pattern, i)
            last_atom_end = i
            continue
        if c == "(":
            stack.append([i, False])
            i += 1
            continue
        if c == ")" and stack:
            start, holds_repeat = stack.pop()
            i += 1
            low_high = _quantifier(pattern, i)
            if low_high is not None:
                low, high, end = low_high
                if low == 0 and high == 1 and holds_repeat and _has_text_before(pattern, int(start)):
                    return pattern[int(start) : end]
                if (high is None or high > 1) and stack:
                    stack[-1][1] = True
            if holds_repeat and stack:
                stack[-1][1] = True
            last_atom_end = i
            continue
        low_high = _quantifier(pattern, i)
        if low_high is not None:
            low, high, end = low_high
            if (high is None or high > 1) and stack:
                stack[-1][1] = True
            i = end
            continue
        i += 1
        last_atom_end = i
    del last_atom_end
    return None


def _has_text_before(pattern: str, start: int) -> bool:
    """Whether something other than `^` and group openings comes before `start` (xgrammar
    reads a leading optional group correctly)."""
    return any(c not in "^(?:" for c in pattern[:start])


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at `i`."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def _quantifier(pattern: str, i: int) -> tuple[int, int | None, int] | None:
    """(low, high or None for unbounded, end index) of a quantifier at `i`, or None; a lazy or
    possessive suffix is part of it."""
    if i >= len(pattern):
        return None
    c = pattern[i]
    if c in "*+?":
        low, high, end = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c] + (i + 1,)
    elif c == "{":
        close = pattern.find("}", i)
        body = pattern[i + 1 : close] if close > 0 else ""
        parts = body.split(",")
        if (
            not body
            or len(parts) > 2
            or not all(p.strip().isdigit() or (k == 1 and not p.strip()) for k, p in enumerate(parts))
        ):
            return None
        low = int(parts[0])
        high = low if len(parts) == 1 else (int(parts[1]) if parts[1].strip() else None)
        end = close + 1
    else:
        return None
    if end < len(pattern) and pattern[end] in "?+":
        end += 1
    return low, high, end
