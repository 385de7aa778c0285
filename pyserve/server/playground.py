"""The browser pages: `/` a chat playground and `/docs` the API reference (rendered from
/openapi.json), with the static files they load, all served from this package: no CDN, so the
pages work offline (docs/playground.md says what they show).

The pages are plain HTML, CSS and JavaScript modules under pyserve/server/static/ (no build
step). Every file is served by a route of its own (a fixed table: no request path ever names a
file), left out of the OpenAPI document (include_in_schema=False). The files hold no server
data, so `--api-key` leaves them open (PUBLIC_PATHS, read by pyserve.server.auth); everything
the pages show comes from API calls that send the key the user types (kept in the browser's
localStorage). Loop thread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

STATIC_DIR = Path(__file__).parent / "static"

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}

# The pages load only this server's own files and call only its API; no other site may frame
# them (the key field is a password field).
PAGE_POLICY = "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"

# URL path -> (file, its Content-Security-Policy: pages only)
PAGES = {"/": "playground.html", "/docs": "docs.html"}
ASSETS = ["playground.css", "docs.css", "favicon.svg", "api.js", "sse.js", "chat.js", "conversation.js",
          "status.js", "playground.js", "docs.js"]  # fmt: skip
FILES: dict[str, tuple[Path, str | None]] = {
    **{url: (STATIC_DIR / name, PAGE_POLICY) for url, name in PAGES.items()},
    **{f"/static/{name}": (STATIC_DIR / name, None) for name in ASSETS},
}

# what pyserve.server.auth lets through without the API key
PUBLIC_PATHS = frozenset(FILES)


def _endpoint(path: Path, policy: str | None) -> Callable[[Request], Awaitable[Response]]:
    # no-cache: the browser revalidates (ETag), so an upgraded server's pages show at once
    headers = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
    if policy is not None:
        headers["Content-Security-Policy"] = policy
    media_type = MEDIA_TYPES[path.suffix]

    async def serve(request: Request) -> Response:
        return FileResponse(path, media_type=media_type, headers=headers)

    return serve


ROUTES = [
    Route(url, _endpoint(path, policy), methods=["GET"], include_in_schema=False)
    for url, (path, policy) in FILES.items()
]
