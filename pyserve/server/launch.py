"""`launch_server(server_args)`: check the model path, bind the port, then run the app with
uvicorn on a uvloop event loop while the model loads."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from pyserve.config import ServerArgs, setup_logging
from pyserve.model_loader.default_model import ModelNotFoundError, default_model_path
from pyserve.model_loader.model_path import check_model_path
from pyserve.server.http1 import HTTP1Protocol

logger = logging.getLogger(__name__)

# seconds a server whose serving failed (a tensor-parallel rank died) still answers 503
# before it exits
FAILED_LINGER_S = 2.0


class StartupError(Exception):
    """The server cannot start: a bad --model-path or a port it cannot listen on. Raised
    before the model loads; the message is one line."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), SO_REUSEADDR set, not yet listening (uvicorn
    listens once the app has started). Raises StartupError when the address is taken or
    cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise StartupError(f"--host {host}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise StartupError(f"--host {host} --port {port}: cannot bind ({exc.strerror or exc})") from None
    sock.set_inheritable(True)
    return sock


def launch_server(server_args: ServerArgs) -> int:
    """Serve until SIGTERM / SIGINT, then drain (pyserve.server.drain); blocks the calling
    thread. The port answers while the model loads (`/health` 503 until then). Returns the
    exit status: 0, or 1 when the model failed to load (logged with its traceback) or
    serving failed (a tensor-parallel rank died: one line in the log). Raises
    StartupError, before torch or the model loads, for a bad --model-path or a port taken."""
    setup_logging(server_args.log_level)
    try:
        check_model_path(server_args.model_path or default_model_path())
    except ModelNotFoundError as exc:
        raise StartupError(str(exc)) from None
    sock = bind_socket(server_args.host, server_args.port)
    from pyserve.server.app import create_app  # torch and the engine: after the checks
    from pyserve.server.drain import DrainingServer

    failed: list[BaseException | str] = []

    def load_failed(exc: BaseException | str) -> None:
        failed.append(exc)
        server.should_exit = True

    def serving_failed(message: str) -> None:  # on the loop
        failed.append(message)
        # the routes answer 503 (`/health`: {"status": "failed"}) a moment longer, so a
        # probe or router sees why the server goes away
        asyncio.get_running_loop().call_later(FAILED_LINGER_S, setattr, server, "should_exit", True)

    app = create_app(server_args, load_in_background=True, on_load_error=load_failed, on_failure=serving_failed)
    logger.info("starting pyserve on http://%s:%d", server_args.host, server_args.port)
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        loop="uvloop",
        http=HTTP1Protocol,
        log_level=server_args.log_level,
        access_log=server_args.log_level == "debug",
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, app, server_args.shutdown_timeout_s)
    server.run(sockets=[sock])
    return 1 if failed else 0
