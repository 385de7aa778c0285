"""The Detokenizer: one step's TokenOuts -> GenerateOutput chunks; one coroutine on the loop thread.

It drives the requests' incremental decoding (incremental_decode.py: `DecodeState`, the
DecodeStream step and the batched decode of text windows) for those that need text now,
applies stop strings (the earliest match cuts the text; text that could be the start of a
stop string is held back until it cannot, so the streamed chunks always concatenate to the
final text), builds the SGLang logprob entries, and delivers each request's chunks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from pyserve.engine.incremental_decode import (
    PROMPT_CONTEXT_TOKENS,
    DecodeState,
    advance_texts,
    batch_decoder,
    decode_one,
    stream_backend,
)
from pyserve.forward_batch_info import FinishKind, FinishReason, TokenLogprobs, TokenOut
from pyserve.io_struct import GenerateOutput, IdsPrefix, LogprobParams, json_safe_logprob


class Detokenizer:
    """Consumes TokenOut lists from the scheduler; delivers GenerateOutput chunks.

    `deliver(output)` hands a chunk to the request's consumer; `finish(rid, reason)` tells the
    scheduler a stop string ended the request. Text is decoded for the requests that need it
    now: streamed ones (every stream_interval tokens) and those with stop strings advance by
    one `tokenizers` DecodeStream step each (Rust; O(new tokens)); a request's last text (which
    is flushed even if it ends in an incomplete character), a request that is neither streamed
    nor stopped by strings (decoded once, when it finishes) and tokenizers without
    DecodeStream go through the backend's decode, one call per text window (Rust, GIL kept:
    see `batch_decoder`).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        deliver: Callable[[GenerateOutput], None],
        finish: Callable[[str, FinishReason], None],
    ) -> None:
        self.tokenizer = tokenizer
        self.deliver = deliver
        self.finish = finish
        self.states: dict[str, DecodeState] = {}
        self.queue: asyncio.Queue[list[TokenOut]] = asyncio.Queue()
        self._decode_batch = batch_decoder(tokenizer)
        self._stream_backend = stream_backend(tokenizer)

    def register(
        self,
        rid: str,
        stop_strs: list[str],
        skip_special_tokens: bool,
        logprob: LogprobParams | None = None,
        prompt_ids: Sequence[int] | np.ndarray | None = None,
        no_stop_trim: bool = False,
        stream: bool = True,
        stream_interval: int = 1,
    ) -> None:
        """Start tracking `rid`. prompt_ids: the prompt (its last PROMPT_CONTEXT_TOKENS are
        the decoding context). no_stop_trim: keep a matched stop string or token in the text.
        stream: deliver chunks (every `stream_interval` tokens), else only the final output."""
        tail = [int(t) for t in (prompt_ids if prompt_ids is not None else [])[-PROMPT_CONTEXT_TOKENS:]]
        self.states[rid] = DecodeState(
            stop_strs, skip_special_tokens, logprob, tail, no_stop_trim, stream, stream_interval
        )

    def forget(self, rid: str) -> None:
        self.states.pop(rid, None)

    async def run(self) -> None:
        while True:
            self.handle_batch(await self.queue.get())

    def handle(self, out: TokenOut) -> None:
        self.handle_batch([out])

    def handle_batch(self, outs: list[TokenOut]) -> None:
        """Take one step's TokenOuts: append ids, decode what needs text now (one batched
        call), apply stop strings, deliver chunks."""
        states = self.states
        todo: list[tuple[TokenOut, DecodeState]] = []
        for out in outs:
            state = states.get(out.rid)
            if state is None or state.finish_reason is not None:
                continue  # unknown, or already ended by a stop string: extra tokens are dropped
            if out.finish_reason is None and state.logprob is None:
                # the common step: one more token, nothing to trim (inline `_append`)
                state.ids.extend(out.ids_delta)
                state.decode_ids.extend(out.ids_delta)
                if state.stop_strs or (state.stream and len(state.ids) - state.sent_ids >= state.stream_interval):
                    todo.append((out, state))
                continue
            self._append(state, out)
            if self._needs_text(state, out):
                todo.append((out, state))
        if todo:
            self._decode_states([state for _, state in todo], [o.finish_reason is not None for o, _ in todo])
        stream_chunk, finish_chunk = self._stream_chunk, self._finish_chunk
        for out, state in todo:
            if out.finish_reason is None and not state.stop_strs and state.logprob is None:
                stream_chunk(out, state)  # a running step: no stop strings, no logprobs
            else:
                finish_chunk(out, state)

    def _append(self, state: DecodeState, out: TokenOut) -> None:
        state.ids.extend(out.ids_delta)
        reason = out.finish_reason
        if (
            reason is not None
            and isinstance(reason.matched, int)
            and not state.no_stop_trim
            and out.ids_delta
            and out.ids_delta[-1] == reason.matched
        ):
            state.decode_ids.extend(out.ids_delta[:-1])  # the stop token's text is trimmed
        else:
            state.decode_ids.extend(out.ids_delta)
        if state.logprob is not None:
            self._add_logprobs(state, out)

    @staticmethod
    def _needs_text(state: DecodeState, out: TokenOut) -> bool:
        if out.finish_reason is not None or state.stop_strs:
            return True
        return state.stream and len(state.ids) - state.sent_ids >= state.stream_interval

    def _decode_states(self, states: list[DecodeState], flush: list[bool]) -> None:
        """Advance the text of `states` (see `advance_texts`)."""
        advance_texts(states, flush, self._stream_backend, self._decode_batch)

    def _finish_chunk(self, out: TokenOut, state: DecodeState) -> None:
        """Stop strings, logprobs and the last output of a request (`handle_batch` gives the
        plain running steps to `_stream_chunk`)."""
        finished = out.finish_reason is not None
        if not finished and self._match_stop(state):
            self.finish(out.rid, state.finish_reason)  # type: ignore[arg-type]
            finished = True
        else:
            state.finish_reason = out.finish_reason
        if finished:
            self._match_stop(state)  # a stop string in the flushed tail still counts
        elif not state.stream:
            return  # not streamed: only the final output is delivered
        emit_len = len(state.text) if finished else len(state.text) - self._holdback(state)
        if not finished and len(state.ids) - state.sent_ids < state.stream_interval:
            return
        delta = state.text[state.sent_len : emit_len]
        if not delta and not finished and len(state.ids) == state.sent_ids:
            return
        ids_delta = state.ids[state.sent_ids :]
        state.sent_len = max(state.sent_len, emit_len)
        state.sent_ids = len(state.ids)
        if finished:
            self.states.pop(out.rid, None)
        logprobs = None
        num_logprobs_delta = 0
        if state.logprob is not None:
            logprobs = {k: list(v) if v is not None else None for k, v in state.logprobs.items()}
            output_lists = state.logprobs["output_token_logprobs"]
            assert output_lists is not None  # set by the first _add_logprobs
            num_logprobs_delta = len(output_lists) - state.sent_logprobs
            state.sent_logprobs += num_logprobs_delta
        self.deliver(
            GenerateOutput(
                rid=out.rid,
                text=state.text[: state.sent_len],
                text_delta=delta,
                output_ids=IdsPrefix(state.ids),
                ids_delta=ids_delta,
                prompt_tokens=out.prompt_tokens,
                cached_tokens=out.cached_tokens,
                finish_reason=state.finish_reason,
                logprobs=logprobs,
                num_logprobs_delta=num_logprobs_delta,
                embedding=out.embedding,
            )
        )

    def _stream_chunk(self, out: TokenOut, state: DecodeState) -> None:
        """`_finish_chunk` for the step of a running request with no stop strings and no
        logprobs (the text only grows; nothing is held back): deliver the new text and ids
        when `stream_interval` tokens have come."""
        ids = state.ids
        num_ids = len(ids)
        if not state.stream or num_ids - state.sent_ids < state.stream_interval:
            return
        text = state.text
        delta = text[state.sent_len :]
        if not delta and num_ids == state.sent_ids:
            return
        ids_delta = ids[state.sent_ids :]
        state.sent_len = len(text)
        state.sent_ids = num_ids
        # (positional: rid, text, text_delta, output_ids, ids_delta, prompt_tokens, cached_tokens)
        self.deliver(
            GenerateOutput(
                out.rid, text, delta, IdsPrefix(ids, num_ids), ids_delta, out.prompt_tokens, out.cached_tokens
            )
        )

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
            decode = decode_one(self.tokenizer)
            both, alone = decode([anchor, token_id]), decode([anchor])
            text = both[len(alone) :] if both.startswith(alone) else decode([token_id])
            if len(cache) < 1 << 20:
                cache[token_id] = text
        return text

    def _entry(self, logprob: float | None, token_id: int, with_text: bool) -> list[Any]:
        return [json_safe_logprob(logprob), token_id, self.token_text(token_id) if with_text else None]

    def _entries(
        self, items: TokenLogprobs, ids: list[int], prefix: str, with_text: bool, lists: dict[str, list | None]
    ) -> None:
        chosen = lists.get(f"{prefix}_token_logprobs")
        if chosen is None:
            chosen = lists[f"{prefix}_token_logprobs"] = []
        chosen.extend(self._entry(lp, t, with_text) for lp, t in zip(items.token_logprobs, ids))
        for key, alts in (
            (f"{prefix}_top_logprobs", items.top_logprobs),
            (f"{prefix}_token_ids_logprobs", items.token_ids_logprobs),
        ):
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

    def _match_stop(self, state: DecodeState) -> bool:
        """Cut the text at the earliest stop string, if any; returns True when one matched."""
        reason = state.finish_reason
        if reason is not None and reason.kind is FinishKind.STOP and isinstance(reason.matched, str):
            return False
        best: tuple[int, str] | None = None
        for stop in state.stop_strs:
            pos = state.text.find(stop, max(0, state.sent_len - len(stop)))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        state.text = state.text[: best[0] + (len(best[1]) if state.no_stop_trim else 0)]
        state.finish_reason = FinishReason.stop(best[1])
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
