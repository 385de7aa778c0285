"""The `pyserve` command: `pyserve serve [flags]` (also `python -m pyserve serve`)."""

from __future__ import annotations

import argparse
import sys

from pyserve.config import ServerArgs, ServerArgsError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyserve", description="pyserve: an LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP (native and OpenAI APIs)")
    ServerArgs.add_cli_args(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        try:
            args = ServerArgs.from_cli_args(ns)
        except ServerArgsError as exc:
            parser.error(str(exc))
        from pyserve.server.launch import launch_server

        launch_server(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
