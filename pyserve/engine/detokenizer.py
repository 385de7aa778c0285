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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
from tokenizers import Tokenizer

if TYPE_CHECKING:
    from tokenizers.decoders import DecodeStream  # (older tokenizers lack it: see stream_backend)
    from transformers import PreTrainedTokenizerBase

from pyserve.engine.step_pipeline import TokenOut
from pyserve.forward_batch_info import FinishKind, FinishReason, TokenLogprobs
from pyserve.io_struct import GenerateOutput, IdsPrefix, LogprobParams, json_safe_logprob

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output (SGLang uses the same number).
PROMPT_CONTEXT_TOKENS = 5


def _decode_one(tokenizer: PreTrainedTokenizerBase) -> Callable[..., str]:
    """`tokenizer.decode`, typed for what pyserve passes it: one id list, so one str."""
    return cast("Callable[..., str]", tokenizer.decode)


def batch_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[list[int]], list[bool]], list[str]]:
    """A function decoding many id lists at once: texts[i] = tokenizer.decode(ids[i],
    skip_special_tokens=skips[i]). For a transformers fast tokenizer that adds no clean-up to
    its backend's decode, the backend's (`tokenizers.Tokenizer`) own `decode` per list;
    otherwise the tokenizer's decode per list.

    Not the backend's `decode_batch`: it releases the GIL, and on the loop thread a release
    costs a wait for the GIL to come back, up to the interpreter's switch interval (5 ms)
    whenever another Python thread (the tokenizer's, the worker) is running. Measured for 256
    six-token lists: decode_batch 370 us alone, 6.2 ms beside one busy thread; one decode per
    list 420 us and 1.1 ms (the GIL shared, never given up)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode: Callable[..., str]
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        decode = _decode_one(tokenizer)
    else:
        decode = backend.decode
    return lambda ids, skips: [decode(i, skip_special_tokens=s) for i, s in zip(ids, skips)]


def stream_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` whose `DecodeStream` may decode `tokenizer`'s output one step
    at a time (the same windowed rule as `Detokenizer`, in Rust), or None: when the tokenizer
    is not a transformers fast tokenizer whose decode is its backend's (see `batch_decoder`),
    or the installed `tokenizers` has no DecodeStream with a prefill."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=True)
    except (ImportError, TypeError):
        return None
    return backend


def token_deltas(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """The text each of `ids` adds to the decode of the ones before it, by the same windowed
    incremental decoding as the Detokenizer (a character split over several byte tokens goes
    with the token that completes it). Their concatenation is decode(ids) but in rare
    tokenizer-specific cases; used for the character offsets of echoed prompt tokens."""
    decode = _decode_one(tokenizer)
    deltas: list[str] = []
    prefix_offset = read_offset = 0
    for k in range(len(ids)):
        prefix_text = decode(ids[prefix_offset:read_offset], skip_special_tokens=skip_special_tokens)
        new_text = decode(ids[prefix_offset : k + 1], skip_special_tokens=skip_special_tokens)
        last = k == len(ids) - 1
        if len(new_text) > len(prefix_text) and (last or not new_text.endswith(REPLACEMENT_CHAR)):
            deltas.append(new_text[len(prefix_text) :])
            prefix_offset, read_offset = read_offset, k + 1
        else:
            deltas.append("")
    return deltas


class DecodeState:
    """Per-request text state: all output ids, decoded text, what has been sent.

    decode_ids: the tail of the prompt (context only) followed by the output ids whose text
    belongs in the output (a matched stop token is left out unless no_stop_trim);
    prefix_offset / read_offset index it. stream: chunks are wanted (else one output at the
    end); stream_interval: a chunk every that many new tokens. decode_stream: the `tokenizers`
    DecodeStream that advances the text step by step (made at the first such step), fed with
    decode_ids[:fed] (its window is always decode_ids[prefix_offset:fed]); False once it
    refused a step.
    """

    def __init__(
        self,
        stop_strs: list[str],
        skip_special_tokens: bool,
        logprob: LogprobParams | None = None,
        prompt_tail: list[int] | None = None,
        no_stop_trim: bool = False,
        stream: bool = True,
        stream_interval: int = 1,
    ) -> None:
        self.ids: list[int] = []
        self.decode_ids: list[int] = list(prompt_tail or [])
        self.no_stop_trim = no_stop_trim
        self.logprob = logprob if logprob is not None and logprob.return_logprob else None
        # SGLang meta_info lists, filled only when logprobs were asked for
        self.logprobs: dict[str, list | None] = {}
        self.sent_logprobs = 0
        self.prefix_offset = 0
        self.read_offset = len(self.decode_ids)
        self.text = ""
        self.sent_len = 0
        self.sent_ids = 0
        self.stop_strs = stop_strs
        self.skip_special_tokens = skip_special_tokens
        self.stream = stream
        self.stream_interval = max(1, stream_interval)
        self.finish_reason: FinishReason | None = None
        # None: not made yet; False: this request cannot stream (the batched path has it)
        self.decode_stream: DecodeStream | Literal[False] | None = None
        self.fed = 0


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
        """Advance the text of `states` by the prefix/read-offset rule: a step of each one's
        DecodeStream, or (flushing, or no DecodeStream) one batched decode of both windows
        per skip_special_tokens value."""
        backend = self._stream_backend
        rest: list[DecodeState] = []
        rest_flush: list[bool] = []
        stream_step = self._stream_step
        for state, last in zip(states, flush):
            if last or backend is None or not stream_step(backend, state):
                rest.append(state)
                rest_flush.append(last)
        if not rest:
            return
        windows = [(s.decode_ids[s.prefix_offset : s.read_offset], s.decode_ids[s.prefix_offset :]) for s in rest]
        texts = self._decode_batch(
            [w for pair in windows for w in pair], [s.skip_special_tokens for s in rest for _ in (0, 1)]
        )
        for k, state in enumerate(rest):
            prefix_text, new_text = texts[2 * k], texts[2 * k + 1]
            if len(new_text) > len(prefix_text) and (rest_flush[k] or not new_text.endswith(REPLACEMENT_CHAR)):
                state.text += new_text[len(prefix_text) :]
                state.prefix_offset = state.read_offset
                state.read_offset = len(state.decode_ids)

    @staticmethod
    def _stream_step(backend: Tokenizer, state: DecodeState) -> bool:
        """Feed `state`'s new decode ids to its DecodeStream (made on first use, on the
        current window); False if the stream cannot take them (the window ends inside a
        character, or the decoder rewrote earlier text): the batched path takes this request
        over for good."""
        ids = state.decode_ids
        stream = state.decode_stream
        if stream is False:
            return False
        if stream is None:
            from tokenizers.decoders import DecodeStream

            window = ids[state.prefix_offset : state.read_offset]
            if backend.decode(window, skip_special_tokens=state.skip_special_tokens).endswith(REPLACEMENT_CHAR):
                # the context ends inside a character (a prompt given as ids, cut there): the
                # stream would count that character's text as the output's
                state.decode_stream = False
                return False
            stream = state.decode_stream = DecodeStream(ids=window, skip_special_tokens=state.skip_special_tokens)
            state.fed = state.read_offset
        fed, num_ids = state.fed, len(ids)
        if fed == num_ids:
            return True
        try:
            # one new id (the usual step) goes as an int: no list to build and convert
            chunk = stream.step(backend, ids[fed] if num_ids - fed == 1 else ids[fed:])
        except Exception:
            state.decode_stream = False
            return False
        state.fed = num_ids
        if chunk is not None:
            state.text += chunk
            state.prefix_offset = state.read_offset
            state.read_offset = state.fed
        return True

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
            decode = _decode_one(self.tokenizer)
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
