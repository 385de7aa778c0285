"""Incremental decoding of one request's output text; the loop thread (the Detokenizer's).

Text is decoded with a small window of context tokens so that word-initial spaces and
multi-byte characters come out exactly as a full decode would: a chunk is emitted only when
the window's text grew and does not end in U+FFFD (an incomplete UTF-8 sequence). This is the
prefix/read-offset technique used by HF text-generation-inference and vLLM, written here anew.
The window starts on the last `PROMPT_CONTEXT_TOKENS` prompt tokens (as SGLang's detokenizer
does): a SentencePiece tokenizer drops the word-initial space of the first token of a decode,
so decoding the output alone would lose the space before the first output word.

Holds `DecodeState` (a request's ids, text and offsets), the two ways its text advances
(`stream_step`: a `tokenizers` DecodeStream step; `advance_texts`: that, or one batched decode
of the windows) and the tokenizer probes that pick them (`batch_decoder`, `stream_backend`).
The Detokenizer (detokenizer.py) drives these per step on the loop thread; `token_deltas`
runs wherever its caller does (EngineCore: the tokenizer's executor thread).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, cast

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from tokenizers.decoders import DecodeStream  # (older tokenizers lack it: see stream_backend)
    from transformers import PreTrainedTokenizerBase

from pyserve.forward_batch_info import FinishReason
from pyserve.io_struct import LogprobParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output (SGLang uses the same number).
PROMPT_CONTEXT_TOKENS = 5


def decode_one(tokenizer: PreTrainedTokenizerBase) -> Callable[..., str]:
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
        decode = decode_one(tokenizer)
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
    decode = decode_one(tokenizer)
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


def stream_step(backend: Tokenizer, state: DecodeState) -> bool:
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


def advance_texts(
    states: list[DecodeState],
    flush: list[bool],
    backend: Tokenizer | None,
    decode_batch: Callable[[list[list[int]], list[bool]], list[str]],
) -> None:
    """Advance the text of `states` by the prefix/read-offset rule: a step of each one's
    DecodeStream (`backend`: see `stream_backend`; None: none), or (flushing, or no
    DecodeStream) one batched decode (`decode_batch`: see `batch_decoder`) of both windows.
    flush[i]: states[i]'s last text, emitted even if it ends in an incomplete character."""
    rest: list[DecodeState] = []
    rest_flush: list[bool] = []
    for state, last in zip(states, flush):
        if last or backend is None or not stream_step(backend, state):
            rest.append(state)
            rest_flush.append(last)
    if not rest:
        return
    windows = [(s.decode_ids[s.prefix_offset : s.read_offset], s.decode_ids[s.prefix_offset :]) for s in rest]
    texts = decode_batch([w for pair in windows for w in pair], [s.skip_special_tokens for s in rest for _ in (0, 1)])
    for k, state in enumerate(rest):
        prefix_text, new_text = texts[2 * k], texts[2 * k + 1]
        if len(new_text) > len(prefix_text) and (rest_flush[k] or not new_text.endswith(REPLACEMENT_CHAR)):
            state.text += new_text[len(prefix_text) :]
            state.prefix_offset = state.read_offset
            state.read_offset = len(state.decode_ids)
