"""`ApiKeyMiddleware`: the `--api-key` check, a pure ASGI middleware (it passes `receive` and
`send` through untouched, so streamed responses keep their writer)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from pyserve.server.playground import PUBLIC_PATHS
from pyserve.server.render import SafeJSONResponse, error_body

# SGLang's exemptions: health checks (load balancers probe them without credentials), the
# Prometheus scrape and CORS preflight requests (browsers send them without credentials); and
# the browser pages' static files (no server data in them: their API calls send the key)
EXEMPT_PREFIXES = ("/health",)
EXEMPT_PATHS = frozenset({"/metrics"}) | PUBLIC_PATHS


class ApiKeyMiddleware:
    """Answers 401 with an OpenAI-style error object (code "invalid_api_key") to an HTTP
    request without `Authorization: Bearer <api_key>`, except OPTIONS, EXEMPT_PATHS and paths
    under EXEMPT_PREFIXES. The key is compared in constant time (hmac.compare_digest). Loop thread."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = error_body(
            "a valid API key is required: send `Authorization: Bearer <key>`",
            "invalid_request_error",
            None,
            "invalid_api_key",
        )
        response = SafeJSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        path = scope["path"]
        if scope["method"] == "OPTIONS" or path in EXEMPT_PATHS or path.startswith(EXEMPT_PREFIXES):
            return True
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        return hmac.compare_digest(given, self._expected)
