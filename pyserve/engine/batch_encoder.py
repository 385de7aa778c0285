"""`BatchEncoder`: the prompts' token ids, encoded on the tokenizer's executor thread.

`encode` is awaited on the loop thread; the texts of the requests arriving in one loop turn
are gathered there and encoded in one batched call on the executor thread (one worker, named
pyserve-tokenizer; EngineCore and the routes run their decodes on it too), so the loop never
runs a tokenizer. Used by the TokenizerManager.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class BatchEncoder:
    """Batched encoding of texts for the loop: `encode` on the loop thread, the tokenizer's
    calls on `executor`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyserve-tokenizer")
        self._pending: list[tuple[str, bool, asyncio.Future]] = []
        self._plain_backend = _encodes_like_backend(tokenizer)

    async def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """Token ids of `text`, [n] int32. Texts of requests arriving together are encoded in one
        batched call on the executor thread (the tokenizer's `encode_batch`, which runs in
        Rust with the GIL released), so a burst of requests neither holds the GIL against
        the loop and the worker nor pays the per-call overhead once per prompt. If the
        batch fails, each text is encoded alone, so only a bad one fails its request."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._pending.append((text, add_special_tokens, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)
        return await future

    def _encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[np.ndarray]:
        """Executor thread: ids of `texts`, [n] int32 each (made here, off the loop). A
        transformers fast tokenizer that adds nothing to its backend's encoding goes straight
        to `tokenizers.Tokenizer.encode_batch` (its encode is that call, and the batch call
        holds the GIL only to hand back the ids); any other tokenizer through its own batched
        call."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and self._plain_backend:
            return [
                np.array(e.ids, dtype=np.int32)
                for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)
            ]
        return [
            np.array(ids, dtype=np.int32)
            for ids in self.tokenizer(texts, add_special_tokens=add_special_tokens, return_attention_mask=False)[
                "input_ids"
            ]
        ]

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        loop = asyncio.get_running_loop()

        def work() -> list[np.ndarray | BaseException]:
            ids: list[np.ndarray | BaseException] = [np.zeros(0, dtype=np.int32) for _ in pending]
            for flag in (True, False):
                picked = [k for k, (_, special, _) in enumerate(pending) if special is flag]
                if not picked:
                    continue
                try:
                    rows: list[np.ndarray | BaseException] = list(
                        self._encode_batch([pending[k][0] for k in picked], flag)
                    )
                except Exception:  # one bad text: encode them one by one
                    rows = []
                    for k in picked:
                        try:
                            rows.append(self._encode_batch([pending[k][0]], flag)[0])
                        except Exception as exc:
                            rows.append(exc)
                for k, row in zip(picked, rows):
                    ids[k] = row
            return ids

        def done(job: asyncio.Future) -> None:
            exc = job.exception()
            for k, (_, _, future) in enumerate(pending):
                if future.done():
                    continue
                if exc is not None:
                    future.set_exception(exc)
                    continue
                row = job.result()[k]
                if isinstance(row, BaseException):
                    future.set_exception(row)
                else:
                    future.set_result(row)

        asyncio.ensure_future(loop.run_in_executor(self.executor, work)).add_done_callback(done)


def _encodes_like_backend(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer.encode(text, add_special_tokens=f)` is its backend's
    `encode(text, add_special_tokens=f).ids`: checked once on probe texts (a tokenizer class
    may prepend or rewrite; then its own batched call is used)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    probes = ["Hello world!", "  two  spaces\nand a line", "caf\u00e9 \u65e5\u672c <s> </s>"]
    try:
        return all(
            tokenizer.encode(t, add_special_tokens=f) == backend.encode(t, add_special_tokens=f).ids
            for t in probes
            for f in (True, False)
        )
    except Exception:  # a tokenizer whose backend cannot encode these: use its own calls
        return False
