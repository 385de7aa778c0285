"""The bench client's SSE reader: events cut anywhere by the network, LF and CRLF line ends."""

from __future__ import annotations

import asyncio

import pytest

from pyserve.bench.backends import _sse_data


class _Pieces:
    """A stand-in for aiohttp's StreamReader: iter_any() yields the given pieces."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def iter_any(self):
        for piece in self.pieces:
            yield piece


def _read(pieces: list[bytes]) -> list[bytes]:
    async def run() -> list[bytes]:
        return [data async for data in _sse_data(_Pieces(pieces))]  # type: ignore[arg-type]
    return asyncio.run(run())


BODY = b'data: {"text":"a"}\n\n: comment\n\ndata:{"text":"b c"}\n\nevent: x\ndata: [DONE]\n\n'
EXPECTED = [b'{"text":"a"}', b'{"text":"b c"}', b"[DONE]"]


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 16, len(BODY)])
def test_events_cut_into_pieces_of_any_size(cut: int) -> None:
    pieces = [BODY[k:k + cut] for k in range(0, len(BODY), cut)]
    assert _read(pieces) == EXPECTED


def test_crlf_line_ends_and_a_last_line_without_newline() -> None:
    body = BODY.replace(b"\n", b"\r\n")
    assert _read([body[:5], body[5:31], body[31:]]) == EXPECTED
    assert _read([b'data: {"n":1}\n\ndata: {"n"', b":2}"]) == [b'{"n":1}', b'{"n":2}']


def test_no_data_lines() -> None:
    assert _read([b": keep-alive\n\n", b""]) == []
