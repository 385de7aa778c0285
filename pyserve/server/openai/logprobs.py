"""OpenAI `logprobs` objects built from a GenerateOutput's SGLang-style logprob lists.

Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}. Completions: {"tokens", "token_logprobs", "top_logprobs" ({token: logprob} per
position), "text_offset"}. Entries are [logprob, token_id, text]; -inf logprobs were already
turned into LOGPROB_FLOOR (-9999.0) by the detokenizer.
"""

from __future__ import annotations

from typing import Any

from pyserve.io_struct import GenerateOutput


def _token(entry: list[Any]) -> dict[str, Any]:
    text = entry[2] or ""
    return {"token": text, "logprob": entry[0], "bytes": list(text.encode("utf-8"))}


def chat_logprobs(out: GenerateOutput, start: int, end: int | None = None) -> dict[str, Any] | None:
    """The chat `logprobs` of output tokens start..end (None when not asked for)."""
    if out.logprobs is None:
        return None
    entries = out.logprobs["output_token_logprobs"][start:end]
    tops = out.logprobs.get("output_top_logprobs")
    content = []
    for k, entry in enumerate(entries):
        item = _token(entry)
        alts = tops[start + k] if tops is not None else None
        item["top_logprobs"] = [_token(a) for a in alts or []]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    out: GenerateOutput,
    start: int,
    end: int | None = None,
    echo: bool = False,
    text_offset: int = 0,
    prompt_offsets: list[int] | None = None,
) -> dict[str, Any] | None:
    """The completions `logprobs` of output tokens start..end, preceded by the prompt's
    tokens when `echo` (the first prompt token has a null logprob and null top_logprobs).
    text_offset: character offset in the choice's text of the first output token; each next
    one starts where the previous token's text ends. prompt_offsets: with echo, where each
    prompt token starts in the echoed text (else counted from 0 the same way)."""
    if out.logprobs is None:
        return None
    entries: list[list[Any]] = []
    tops: list[Any] = []
    offsets: list[int] = []
    if echo and out.logprobs.get("input_token_logprobs"):
        prompt_entries = out.logprobs["input_token_logprobs"]
        entries += prompt_entries
        tops += out.logprobs.get("input_top_logprobs") or [None] * len(prompt_entries)
        if prompt_offsets is not None and len(prompt_offsets) == len(prompt_entries):
            offsets += prompt_offsets
        else:
            offsets += _running_offsets(prompt_entries, 0)
    outputs = out.logprobs["output_token_logprobs"][start:end]
    entries += outputs
    out_tops = out.logprobs.get("output_top_logprobs")
    tops += out_tops[start : start + len(outputs)] if out_tops is not None else [None] * len(outputs)
    offsets += _running_offsets(outputs, text_offset)
    return {
        "tokens": [e[2] or "" for e in entries],
        "token_logprobs": [e[0] for e in entries],
        "top_logprobs": [None if alts is None else {a[2] or "": a[0] for a in alts} for alts in tops],
        "text_offset": offsets,
    }


def _running_offsets(entries: list[list[Any]], start: int) -> list[int]:
    offsets = []
    for entry in entries:
        offsets.append(start)
        start += len(entry[2] or "")
    return offsets


def text_end(logprobs: dict[str, Any]) -> int:
    """Where the text of the last token of a completions `logprobs` object ends."""
    if not logprobs["tokens"]:
        return 0
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
