"""`launch_server(server_args)`: check the model path, bind the port, then run the app with
uvicorn on a uvloop event loop while the model loads."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING

import uvicorn

from pyserve.config import ServerArgs, setup_logging
from pyserve.distributed.tp_check import TPSizeError, check_tp_size
from pyserve.model_loader.chat_template import ChatTemplateError, load_chat_template
from pyserve.model_loader.default_model import ModelNotFoundError, default_model_path
from pyserve.model_loader.hub import resolve_hub_paths
from pyserve.model_loader.model_path import check_model_path
from pyserve.server.drain import signals_exit_now
from pyserve.server.http1 import HTTP1Protocol

if TYPE_CHECKING:
    from pyserve.engine.engine_core import EngineCore  # (imports torch: loaded after the checks)

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
    thread. The port answers while the model loads (`/health` 503 until then); a line says
    when the model serves (`ready_line`). Returns the exit status: 0, or 1 when the model
    failed to load (logged with its traceback) or serving failed (a tensor-parallel rank
    died: one line in the log). A second signal during the drain, or a signal while the model
    loads, ends the process at once with status 128 + the signal's number (130 for Ctrl-C,
    143 for SIGTERM) after one line on stderr (DrainingServer). Raises
    StartupError, before torch or the model loads, for a bad --model-path, --chat-template
    or --tp-size (one the model cannot be split by), or a port taken.
    A Hugging Face Hub id as --model-path / --tokenizer-path is downloaded first, unless
    cached (`resolve_hub_paths`), and the server loads the local snapshot."""
    setup_logging(server_args.log_level)
    if server_args.chat_template is not None:  # first: a mistyped name need not wait for a download
        try:
            load_chat_template(server_args.chat_template)  # (read again when the tokenizer loads)
        except ChatTemplateError as exc:
            raise StartupError(str(exc)) from None
    try:
        with signals_exit_now("while fetching the model"):
            server_args = resolve_hub_paths(server_args)
        check_model_path(server_args.model_path or default_model_path())
        check_tp_size(server_args.model_path or default_model_path(), server_args.tp_size)
    except (ModelNotFoundError, TPSizeError) as exc:
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

    url = server_url(server_args.host, server_args.port)

    def ready(engine: EngineCore) -> None:  # on the loop, once the model serves
        logger.info("%s", ready_line(engine, url))

    app = create_app(
        server_args, load_in_background=True, on_load_error=load_failed, on_failure=serving_failed, on_ready=ready
    )
    logger.info("starting pyserve on %s (loading the model; /health answers 503 until it is ready)", url)
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        loop="uvloop",
        http=HTTP1Protocol,
        # uvicorn's lines in pyserve's format, and only its warnings unless --log-level debug:
        # its "Application startup complete" comes before the model loads (the ready line
        # says when it serves)
        log_config=None,
        log_level=uvicorn_log_level(server_args.log_level),
        access_log=False,  # pyserve writes its own (server/access_log.py)
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, app.context, server_args.shutdown_timeout_s)
    server.run(sockets=[sock])
    if failed:
        return 1
    logger.info("pyserve stopped")
    return 0


def server_url(host: str, port: int) -> str:
    """The base URL of a server listening on (host, port)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_log_level(level: str) -> str:
    """uvicorn's own log level under pyserve's `--log-level`: at least warning, unless debug."""
    level = level.lower()
    if level == "debug" or logging.getLevelName(level.upper()) >= logging.WARNING:
        return level
    return "warning"


def ready_line(engine: EngineCore, url: str) -> str:
    """The line saying the server serves: where, which model (its file or folder name, and
    the name the API serves it under when --served-model-name sets one; a Hub model's served
    name and commit), on which device and
    dtype, and the KV cache's size in tokens and bytes. Loop thread (reads the engine)."""
    device, dtype, kv_tokens, kv_bytes = engine.ready_facts()
    path = engine.model_path.rstrip("/")
    if os.path.basename(os.path.dirname(path)) == "snapshots":  # a Hub model in the HF cache
        model = f"{engine.model_name} (commit {os.path.basename(path)[:12]})"
    else:
        model = os.path.basename(path)
        if engine.server_args.served_model_name:
            model += f" (served as {engine.model_name})"
    return (
        f"pyserve ready on {url}: {model} on {device} ({dtype}), "
        f"KV cache {kv_tokens:,} tokens ({_bytes_text(kv_bytes)})"
    )


def _bytes_text(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
