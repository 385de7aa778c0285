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
    pieces = [BODY[k : k + cut] for k in range(0, len(BODY), cut)]
    assert _read(pieces) == EXPECTED


def test_crlf_line_ends_and_a_last_line_without_newline() -> None:
    body = BODY.replace(b"\n", b"\r\n")
    assert _read([body[:5], body[5:31], body[31:]]) == EXPECTED
    assert _read([b'data: {"n":1}\n\ndata: {"n"', b":2}"]) == [b'{"n":1}', b'{"n":2}']


def test_no_data_lines() -> None:
    assert _read([b": keep-alive\n\n", b""]) == []


def test_streamed_requests_reuse_their_connection() -> None:
    """After [DONE] the client reads the body to its end, so the session's pool keeps the
    connection: four streamed requests in a row use one connection (a half-read response
    would close it, and each request would connect anew). Timings end at [DONE]."""
    import aiohttp
    from aiohttp import web

    from pyserve.bench.backends import RequestSpec, send_request

    peers: list[object] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(3):  # SGLang's cumulative text
            await resp.write(
                b'data: {"text": "%s", "meta_info": {"prompt_tokens": 1, '
                b'"completion_tokens": %d}}\n\n' % (b"abc"[: k + 1], k + 1)
            )
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.05)  # the body's end comes later (as pyserve's does: a step on)
        await resp.write_eof()
        return resp

    async def run() -> list:
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                spec = RequestSpec("hi", 3, None, True, {}, stream=True)
                return [await send_request(session, "pyserve", f"http://127.0.0.1:{port}", spec, {}) for _ in range(4)]
        finally:
            await runner.cleanup()

    results = asyncio.run(run())
    assert [r.error for r in results] == [None] * 4
    assert len(peers) == 4 and len({id(t) for t in peers}) == 1  # one connection for all four
    assert [[c.text for c in r.chunks] for r in results] == [["a", "b", "c"]] * 4
    assert all(r.end_s >= r.start_s for r in results)
