"""`pyserve bench serve --disable-keepalive`: every request on a connection of its own; without
the flag the client's pool reuses one connection for requests sent one after another."""

from __future__ import annotations

import asyncio

from aiohttp import web

from pyserve.bench.cli import build_parser
from pyserve.bench.datasets import DatasetRow
from pyserve.bench.serve import run_requests

STREAM = [
    b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n',
    b'data: {"choices": [{"index": 0, "text": "b"}]}\n\n',
    b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}\n\n',
    b"data: [DONE]\n\n",
]


def _serve_and_load(flags: list[str]) -> tuple[list, list[int]]:
    """Run `bench serve` flags against a stub /v1/completions (3 timed requests, one warm-up,
    one at a time). Returns (timed results, the client port of each request the server saw)."""
    client_ports: list[int] = []
    transports: list[object] = []  # held, so no transport's id is reused within the test

    async def completions(request: web.Request) -> web.StreamResponse:
        transports.append(request.transport)
        client_ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in STREAM:
            await resp.write(event)
        await resp.write_eof()
        return resp

    async def run() -> list:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        base_url = f"http://127.0.0.1:{port}"
        argv = ["serve", "--backend", "openai", "--base-url", base_url, "--max-concurrency", "1"]
        args = build_parser().parse_args(argv + ["--warmup-requests", "1", "--disable-tqdm", *flags])
        rows = [DatasetRow(f"prompt {k}", 2, 2) for k in range(3)]
        try:
            results, _, warmup = await run_requests(args, base_url, rows, "m", {})
        finally:
            await runner.cleanup()
        assert [w.error for w in warmup] == [None]
        return results

    results = asyncio.run(run())
    return results, client_ports


def test_flag_defaults_to_pooled_connections() -> None:
    assert build_parser().parse_args(["serve"]).disable_keepalive is False
    assert build_parser().parse_args(["serve", "--disable-keepalive"]).disable_keepalive is True


def test_disable_keepalive_opens_a_connection_per_request() -> None:
    results, ports = _serve_and_load(["--disable-keepalive"])
    assert [r.error for r in results] == [None, None, None]
    assert [r.text for r in results] == ["ab", "ab", "ab"]
    assert [r.usage for r in results] == [(1, 2), (1, 2), (1, 2)]
    assert len(ports) == 4  # the warm-up and 3 timed requests
    assert len(set(ports)) == 4  # each from a connection of its own


def test_default_reuses_one_connection() -> None:
    results, ports = _serve_and_load([])
    assert [r.error for r in results] == [None, None, None]
    assert len(ports) == 4
    assert len(set(ports)) == 1
