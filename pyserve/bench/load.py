"""Load shape and token counting of `pyserve bench serve`.

* `arrival_offsets_s`: when each request is sent, relative to the run's start. With
  request_rate = inf every offset is 0 (all at once). Otherwise the gaps between arrivals are
  gamma distributed with shape = burstiness and scale = 1 / (request_rate * burstiness): the
  mean gap is 1 / request_rate whatever the burstiness; burstiness 1 is a Poisson process
  (exponential gaps), below 1 burstier, above 1 more regular. The first request goes at 0.
* `to_record`: a RawResult becomes a RequestRecord with token counts from the chosen source.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from pyserve.bench.backends import RawResult
from pyserve.bench.metrics import RequestRecord

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKEN_COUNT_SOURCES = ("auto", "usage", "tokenizer")


def arrival_offsets_s(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start, non-decreasing, first = 0.0."""
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def chunk_token_counts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[int]:
    """Tokens each text chunk adds to the output, by the tokenizer: with L_i the token count of
    the concatenation of chunks 0..i, chunk i adds max(0, L_i - max(L_0..L_{i-1})). The counts
    sum to the token count of the whole text when no prefix tokenizes longer than it (merges
    across a chunk boundary are absorbed by the running maximum)."""
    counts, best, acc = [], 0, ""
    for text in texts:
        acc += text
        n = len(tokenizer.encode(acc, add_special_tokens=False))
        counts.append(max(0, n - best))
        best = max(best, n)
    return counts


def to_record(
    raw: RawResult, dataset_prompt_len: int, source: str, tokenizer: PreTrainedTokenizerBase
) -> RequestRecord:
    """The RequestRecord of `raw`. source: "usage" (the server's prompt/completion tokens) or
    "tokenizer" (the dataset's prompt_len; the output text re-encoded).

    Per-chunk token counts: the server's when it reports them per chunk (pyserve's native
    stream), else chunk_token_counts. Chunks adding no token are dropped (they carry no
    token's arrival). Raises ValueError for source "usage" when raw has no usage.
    """
    rec = RequestRecord(
        prompt_len=dataset_prompt_len,
        start_s=raw.start_s,
        end_s=raw.end_s,
        error=raw.error,
        error_detail=raw.error_detail,
        cached_len=raw.cached_tokens,
    )
    if raw.error is not None:
        return rec
    if all(c.num_tokens is not None for c in raw.chunks):
        counts = [int(c.num_tokens or 0) for c in raw.chunks]
    else:
        counts = chunk_token_counts(tokenizer, [c.text for c in raw.chunks])
    for chunk, n in zip(raw.chunks, counts):
        if n > 0:
            rec.chunk_times_s.append(chunk.time_s)
            rec.chunk_num_tokens.append(n)
    if source == "usage":
        if raw.usage is None:
            raise ValueError("the server reported no usage")
        rec.prompt_len, rec.output_len = raw.usage
    else:
        rec.output_len = len(tokenizer.encode(raw.text, add_special_tokens=False))
    return rec


def resolve_count_source(requested: str, results: list[RawResult]) -> str:
    """ "usage" or "tokenizer": auto picks usage when every successful request reported it."""
    if requested != "auto":
        return requested
    ok = [r for r in results if r.error is None]
    return "usage" if ok and all(r.usage is not None for r in ok) else "tokenizer"
