"""The `pyserve` command: `pyserve serve [flags]` (also `python -m pyserve serve`) and
`pyserve bench {serve,offline,one-batch} [flags]` (see pyserve.bench.cli)."""

from __future__ import annotations

import argparse
import sys

from pyserve import __version__
from pyserve.config import ServerArgs, ServerArgsError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyserve", description="pyserve: an LLM inference server")
    parser.add_argument("--version", action="version", version=f"pyserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP (native and OpenAI APIs)")
    ServerArgs.add_cli_args(serve)
    # Listed for --help only: main() hands `bench ...` to pyserve.bench.cli before parsing.
    sub.add_parser(
        "bench",
        help="benchmark: serve (load a server), offline (Engine), host (simulated device), one-batch",
        add_help=False,
    )
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of `command` (argparse keeps subparsers in its subcommand action)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":
        from pyserve.bench.cli import main as bench_main

        return bench_main(argv[1:], prog="pyserve bench")
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:  # reported with the usage of the command they were given to
        sub = _subparser(parser, ns.command)
        sub.error(f"unrecognized arguments: {' '.join(unknown)}")
    if ns.command == "serve":
        try:
            args = ServerArgs.from_cli_args(ns)
        except ServerArgsError as exc:
            _subparser(parser, "serve").error(str(exc))
        if args.node_rank > 0:  # a further machine of a tensor-parallel group: ranks only
            from pyserve.distributed.launch import serve_node

            return serve_node(args)
        from pyserve.server.launch import StartupError, launch_server

        try:
            return launch_server(args)
        except StartupError as exc:  # a bad --model-path or a busy port: before anything loads
            print(f"pyserve: error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
