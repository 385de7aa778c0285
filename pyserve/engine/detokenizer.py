"""Incremental detokenization and stop strings, one coroutine on the loop thread.

Text is decoded with a small window of context tokens so that word-initial spaces and
multi-byte characters come out exactly as a full decode would: a chunk is emitted only when
the window's text grew and does not end in U+FFFD (an incomplete UTF-8 sequence). This is the
prefix/read-offset technique used by HF text-generation-inference and vLLM, written here anew.
The window starts on the last `PROMPT_CONTEXT_TOKENS` prompt tokens (as SGLang's detokenizer
does): a SentencePiece tokenizer drops the word-initial space of the first token of a decode,
so decoding the output alone would lose the space before the first output word.
Text that could be the start of a stop string is held back until it cannot, so the streamed
chunks always concatenate to the final text.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from pyserve.engine.scheduler import TokenOut
from pyserve.io_struct import GenerateOutput, LogprobParams, json_safe_logprob
from pyserve.model_executor.forward_batch import TokenLogprobs

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output (SGLang uses the same number).
PROMPT_CONTEXT_TOKENS = 5


def token_deltas(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """The text each of `ids` adds to the decode of the ones before it, by the same windowed
    incremental decoding as the Detokenizer (a character split over several byte tokens goes
    with the token that completes it). Their concatenation is decode(ids) but in rare
    tokenizer-specific cases; used for the character offsets of echoed prompt tokens."""
    decode = tokenizer.decode
    deltas: list[str] = []
    prefix_offset = read_offset = 0
    for k in range(len(ids)):
        prefix_text = decode(ids[prefix_offset:read_offset], skip_special_tokens=skip_special_tokens)
        new_text = decode(ids[prefix_offset:k + 1], skip_special_tokens=skip_special_tokens)
        last = k == len(ids) - 1
        if len(new_text) > len(prefix_text) and (last or not new_text.endswith(REPLACEMENT_CHAR)):
            deltas.append(new_text[len(prefix_text):])
            prefix_offset, read_offset = read_offset, k + 1
        else:
            deltas.append("")
    return deltas


class DecodeState:
    """Per-request text state: all output ids, decoded text, what has been sent.

    decode_ids: the tail of the prompt (context only) followed by the output ids whose text
    belongs in the output (a matched stop token is left out unless no_stop_trim);
    prefix_offset / read_offset index it.
    """

    def __init__(self, stop_strs: list[str], skip_special_tokens: bool,
                 logprob: LogprobParams | None = None, prompt_tail: list[int] | None = None,
                 no_stop_trim: bool = False) -> None:
        self.ids: list[int] = []
        self.decode_ids: list[int] = list(prompt_tail or [])
        self.no_stop_trim = no_stop_trim
        self.logprob = logprob if logprob is not None and logprob.return_logprob else None
        # SGLang meta_info lists, filled only when logprobs were asked for
        self.logprobs: dict[str, list] = {}
        self.sent_logprobs = 0
        self.prefix_offset = 0
        self.read_offset = len(self.decode_ids)
        self.text = ""
        self.sent_len = 0
        self.sent_ids = 0
        self.stop_strs = stop_strs
        self.skip_special_tokens = skip_special_tokens
        self.finish_reason: dict[str, Any] | None = None


class Detokenizer:
    """Consumes TokenOut lists from the scheduler; delivers GenerateOutput chunks.

    `deliver(output)` hands a chunk to the request's consumer; `finish(rid, reason)` tells the
    scheduler a stop string ended the request.
    """

    def __init__(self, tokenizer: Any, deliver: Callable[[GenerateOutput], None],
                 finish: Callable[[str, dict[str, Any]], None]) -> None:
        self.tokenizer = tokenizer
        self.deliver = deliver
        self.finish = finish
        self.states: dict[str, DecodeState] = {}
        self.queue: asyncio.Queue[list[TokenOut]] = asyncio.Queue()

    def register(self, rid: str, stop_strs: list[str], skip_special_tokens: bool,
                 logprob: LogprobParams | None = None, prompt_ids: list[int] | None = None,
                 no_stop_trim: bool = False) -> None:
        """Start tracking `rid`. prompt_ids: the prompt (its last PROMPT_CONTEXT_TOKENS are
        the decoding context). no_stop_trim: keep a matched stop string or token in the text."""
        tail = (prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self.states[rid] = DecodeState(stop_strs, skip_special_tokens, logprob, tail, no_stop_trim)

    def forget(self, rid: str) -> None:
        self.states.pop(rid, None)

    async def run(self) -> None:
        while True:
            outs = await self.queue.get()
            for out in outs:
                self.handle(out)

    def handle(self, out: TokenOut) -> None:
        state = self.states.get(out.rid)
        if state is None or state.finish_reason is not None:
            return  # unknown, or already ended by a stop string: extra tokens are dropped
        state.ids.extend(out.ids_delta)
        reason = out.finish_reason
        if reason is not None and isinstance(reason.get("matched"), int) and not state.no_stop_trim \
                and out.ids_delta and out.ids_delta[-1] == reason["matched"]:
            state.decode_ids.extend(out.ids_delta[:-1])  # the stop token's text is trimmed
        else:
            state.decode_ids.extend(out.ids_delta)
        if state.logprob is not None:
            self._add_logprobs(state, out)
        finished = out.finish_reason is not None
        self._decode(state, flush=finished)
        if not finished and self._match_stop(state):
            self.finish(out.rid, state.finish_reason)  # type: ignore[arg-type]
            finished = True
        else:
            state.finish_reason = out.finish_reason
        if finished:
            self._match_stop(state)  # a stop string in the flushed tail still counts
        emit_len = len(state.text) if finished else len(state.text) - self._holdback(state)
        delta = state.text[state.sent_len:emit_len]
        if not delta and not finished and len(state.ids) == state.sent_ids:
            return
        ids_delta = state.ids[state.sent_ids:]
        state.sent_len = max(state.sent_len, emit_len)
        state.sent_ids = len(state.ids)
        if finished:
            self.states.pop(out.rid, None)
        logprobs = None
        num_logprobs_delta = 0
        if state.logprob is not None:
            logprobs = {k: list(v) if v is not None else None for k, v in state.logprobs.items()}
            num_logprobs_delta = len(state.logprobs["output_token_logprobs"]) - state.sent_logprobs
            state.sent_logprobs += num_logprobs_delta
        self.deliver(GenerateOutput(
            rid=out.rid, text=state.text[:state.sent_len], text_delta=delta,
            output_ids=list(state.ids), ids_delta=ids_delta, prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens, finish_reason=state.finish_reason,
            logprobs=logprobs, num_logprobs_delta=num_logprobs_delta,
        ))

    def token_text(self, token_id: int) -> str:
        """The text one token adds after other text (as in logprob entries), so that the
        entries of consecutive tokens concatenate to the output text. Decoding a token alone
        would drop a SentencePiece word-initial space, so it is decoded after an anchor token
        and the anchor's text removed. Cached per id."""
        cache = self.__dict__.setdefault("_token_texts", {})
        text = cache.get(token_id)
        if text is None:
            anchor = self.__dict__.get("_anchor")
            if anchor is None:
                anchor = self._anchor = self.tokenizer.encode("a", add_special_tokens=False)[-1]
            decode = self.tokenizer.decode
            both, alone = decode([anchor, token_id]), decode([anchor])
            text = both[len(alone):] if both.startswith(alone) else decode([token_id])
            if len(cache) < 1 << 20:
                cache[token_id] = text
        return text

    def _entry(self, logprob: float | None, token_id: int, with_text: bool) -> list[Any]:
        return [json_safe_logprob(logprob), token_id, self.token_text(token_id) if with_text else None]

    def _entries(self, items: TokenLogprobs, ids: list[int], prefix: str, with_text: bool,
                 lists: dict[str, list]) -> None:
        lists.setdefault(f"{prefix}_token_logprobs", []).extend(
            self._entry(lp, t, with_text) for lp, t in zip(items.token_logprobs, ids))
        for key, alts in ((f"{prefix}_top_logprobs", items.top_logprobs),
                          (f"{prefix}_token_ids_logprobs", items.token_ids_logprobs)):
            if alts is None:
                lists.setdefault(key, None)
                continue
            target = lists.get(key)
            if target is None:
                target = lists[key] = []
            target.extend([self._entry(lp, t, with_text) for lp, t in pos] or None for pos in alts)

    def _add_logprobs(self, state: DecodeState, out: TokenOut) -> None:
        lp = state.logprob
        assert lp is not None
        lists = state.logprobs
        with_text = lp.return_text_in_logprobs
        if not lists:
            for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
                lists[key] = None
            lists.update(output_token_logprobs=[], output_top_logprobs=None, output_token_ids_logprobs=None)
        if out.input_logprobs is not None and out.input_logprob_ids is not None:
            lists["input_token_logprobs"] = []
            self._entries(out.input_logprobs, out.input_logprob_ids, "input", with_text, lists)
        if out.output_logprobs is not None and out.ids_delta:
            self._entries(out.output_logprobs, out.ids_delta, "output", with_text, lists)

    def _decode(self, state: DecodeState, flush: bool) -> None:
        if state.finish_reason is not None:
            return
        decode = self.tokenizer.decode
        skip = state.skip_special_tokens
        ids = state.decode_ids
        prefix_text = decode(ids[state.prefix_offset:state.read_offset], skip_special_tokens=skip)
        new_text = decode(ids[state.prefix_offset:], skip_special_tokens=skip)
        if len(new_text) > len(prefix_text) and (flush or not new_text.endswith(REPLACEMENT_CHAR)):
            state.text += new_text[len(prefix_text):]
            state.prefix_offset = state.read_offset
            state.read_offset = len(ids)

    def _match_stop(self, state: DecodeState) -> bool:
        """Cut the text at the earliest stop string, if any; returns True when one matched."""
        if state.finish_reason is not None and state.finish_reason.get("type") == "stop" \
                and isinstance(state.finish_reason.get("matched"), str):
            return False
        best: tuple[int, str] | None = None
        for stop in state.stop_strs:
            pos = state.text.find(stop, max(0, state.sent_len - len(stop)))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        state.text = state.text[:best[0] + (len(best[1]) if state.no_stop_trim else 0)]
        state.finish_reason = {"type": "stop", "matched": best[1]}
        return True

    @staticmethod
    def _holdback(state: DecodeState) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        longest = 0
        for stop in state.stop_strs:
            for n in range(min(len(stop) - 1, len(state.text)), longest, -1):
                if state.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
