"""`launch_server(server_args)`: run the app with uvicorn on a uvloop event loop."""

from __future__ import annotations

import logging

import uvicorn

from pyserve.config import ServerArgs, setup_logging
from pyserve.server.app import create_app
from pyserve.server.http1 import HTTP1Protocol

logger = logging.getLogger(__name__)


def launch_server(server_args: ServerArgs) -> None:
    """Serve until interrupted. Blocks the calling thread."""
    setup_logging(server_args.log_level)
    app = create_app(server_args)
    logger.info("starting pyserve on http://%s:%d", server_args.host, server_args.port)
    uvicorn.run(
        app,
        host=server_args.host,
        port=server_args.port,
        loop="uvloop",
        http=HTTP1Protocol,
        log_level=server_args.log_level,
        access_log=server_args.log_level == "debug",
        timeout_graceful_shutdown=5,
    )
