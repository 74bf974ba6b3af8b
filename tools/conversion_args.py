"""The converters' command-line options, without torch: ``--help`` answers at once.

``tools/conversion.py`` (the work) imports torch and the Qwen3 mapping, about 2 s before a word
is printed; the two converters parse their arguments with what is here and import the work only
after. Every option has a help line and ``--help`` shows its default.
"""

from __future__ import annotations

import argparse

DTYPE_NAMES = ("bf16", "fp16", "fp32")  # --dtype choices; tools/conversion.py DTYPES maps them to torch


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description (the tool's usage lines) kept as written; each option's default shown
    (a required option and an off switch have none worth showing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def new_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows the tool's docstring and every option's default."""
    return argparse.ArgumentParser(prog=prog, description=doc.strip(), formatter_class=HelpFormatter)


def positive_int(text: str) -> int:
    """argparse type for a rank count."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_common_args(parser: argparse.ArgumentParser, tp_help: str, pp_help: str) -> None:
    """Options both converters take: rank counts, --force, --no-progress, --verbose."""
    parser.add_argument("--tp", type=positive_int, default=1, help=tp_help)
    parser.add_argument("--pp", type=positive_int, default=1, help=pp_help)
    parser.add_argument("--force", action="store_true",
                        help="replace an earlier conversion in --out-dir (only the files its manifest lists)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    parser.add_argument("--verbose", action="store_true", help="print worker tracebacks")
