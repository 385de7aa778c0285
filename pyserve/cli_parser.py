"""Argument parsing shared by `pyserve serve` and `pyserve bench`: errors in one line (no usage
block), an unknown flag named with the closest known one, and help that shows defaults."""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, `PROG: error: MESSAGE (see PROG --help)`,
    on stderr with exit status 2: argparse's own usage block runs to fifty lines for pyserve
    serve and buries the line that matters. Subparsers made from it are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends each flag's text with `(default: X)`, except where the text already
    names its default or there is none to show (None, a switch's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default is None
            or action.default is False
            or action.default is argparse.SUPPRESS
            or "default" in text
        ):
            return action.help
        return f"{text} (default: %(default)s)"


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of subcommand `command` (argparse keeps subparsers in its subcommand action);
    `parser` itself when it has no such subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def unrecognized_message(parser: argparse.ArgumentParser, unknown: list[str], positional_hint: str = "") -> str:
    """The one-line complaint about the arguments `parser.parse_known_args` left over
    (`unknown`, not empty): the first flag among them with the closest flag of `parser`
    (difflib's similarity of the names without their dashes, at least 0.6), e.g.
    `unrecognized argument --model-pth (did you mean --model-path?)`. Without a flag among
    them: the first leftover, said to be no flag, with `positional_hint` after a semicolon
    (`{arg}` in it becomes that leftover)."""
    flags = [arg for arg in unknown if arg.startswith("-")]
    if not flags:
        hint = f"; {positional_hint.format(arg=unknown[0])}" if positional_hint else ""
        return f"unrecognized argument {unknown[0]} (this command takes flags only{hint})"
    name = flags[0].split("=", 1)[0]
    # without the dashes every pair of flags would share two characters: --bogus near --host
    options = [opt[2:] for action in parser._actions for opt in action.option_strings if opt.startswith("--")]
    close = difflib.get_close_matches(name.lstrip("-"), options, n=1)
    hint = f" (did you mean --{close[0]}?)" if close else ""
    return f"unrecognized argument {name}{hint}"
