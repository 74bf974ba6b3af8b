"""``launch.train``'s command line: its few flags, the Hydra overrides, and config errors a user can act on.

Why a module: Hydra's compose API (which ``launch/config.py`` uses so that no working directory
or logging is taken over) parses overrides only, so the flags Hydra's own ``@hydra.main`` apps
take (``--cfg job``) reached the override parser and failed as "LexerNoViableAltException: --cfg";
and printing only the first line of a composition error kept "Could not find 'algorithm/dral'"
but dropped the list of presets under it. Here:

- ``--help``, ``--print-config`` (Hydra's ``--cfg job`` / ``--cfg all`` mean the same here),
  ``--verbose`` (= ``loop.verbose=true``: the libraries' logs too, ``launch.console``); any other
  flag is refused naming the ones there are;
- ``explain`` turns a composition error into what to do: an unknown preset keeps Hydra's list of
  the available ones (and the nearest name); an unknown key says that it does not exist in its
  section and suggests the nearest keys (Hydra's "use +key=value to append" is dropped: the
  schema is typed, an appended key would be silently ignored); a bad value names the key and
  why; our own ``ValueError``s are already one line naming the field.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
FLAGS = ("--help", "--print-config", "--verbose", "--cfg job")


@dataclass
class CommandLine:
    """What ``python -m launch.train ...`` asked for."""

    overrides: list[str] = field(default_factory=list)  # Hydra overrides (GROUP=PRESET, KEY=VALUE)
    help: bool = False  # -h / --help: print the usage and exit
    print_config: bool = False  # --print-config / --cfg job: print the composed config and exit


def parse_command_line(argv: Sequence[str]) -> CommandLine:
    """Split ``argv`` into flags and overrides; ``ValueError`` naming an unknown flag."""
    cli, args = CommandLine(), list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            cli.help = True
        elif arg == "--print-config":
            cli.print_config = True
        elif arg == "--verbose":
            cli.overrides.append("loop.verbose=true")
        elif arg in ("--cfg", "-c"):
            what = args.pop(0) if args else ""
            if what not in ("job", "all"):
                raise ValueError(f"{arg} {what}: only 'job' (or 'all') is known here; it is --print-config")
            cli.print_config = True
        elif arg.startswith("-"):
            raise ValueError(f"unknown option {arg} (options: {', '.join(FLAGS)}; settings are "
                             "KEY=VALUE overrides, e.g. loop.steps=10)")
        else:
            cli.overrides.append(arg)
    return cli


def explain(err: Exception) -> str:
    """The lines to print for a config error raised while composing or converting the config."""
    from hydra.errors import MissingConfigException

    text = str(err).strip() or type(err).__name__
    if isinstance(err, MissingConfigException):  # an unknown preset: keep Hydra's list of options
        return _unknown_preset(text)
    cause = err.__cause__
    key = getattr(cause, "full_key", None)
    if cause is not None and key:
        if type(cause).__name__ == "ConfigAttributeError":
            return _unknown_key(str(key), getattr(cause, "object_type", None))
        return f"{key}: {str(cause).splitlines()[0]}"
    return "; ".join(text.split("\nConfig search path:")[0].strip().splitlines())  # e.g. a parse error


def _unknown_preset(text: str) -> str:
    """Hydra's message without its search path, and the nearest preset when there is one."""
    lines = text.split("\nConfig search path:")[0].rstrip().splitlines()
    head = lines[0].removeprefix("In 'config': ")
    missing = head.split("'")[1] if head.count("'") >= 2 else ""  # "algorithm/dral"
    group, _, name = missing.partition("/")
    options = [ln.strip() for ln in lines[1:] if ln.startswith("\t")]
    near = difflib.get_close_matches(name, options, n=3)
    hint = f" (did you mean {group}={near[0]}?)" if near else ""
    return "\n".join([f"{head}{hint}", *(ln for ln in lines[1:] if ln.strip())])


def _unknown_key(key: str, owner) -> str:
    """``key`` does not exist where it was given: the nearest keys of that section."""
    section, _, name = key.rpartition(".")
    where = f"in {section}" if section else "at the top level"
    if not dataclasses.is_dataclass(owner):
        return f"{key}: no such key {where}"
    names = [f.name for f in dataclasses.fields(owner)]
    groups = [] if section else sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir())  # experiment=...
    near = [f"{section}.{n}" if section else n
            for n in difflib.get_close_matches(name, sorted(set(names + groups)), n=3)]
    line = f"{key}: no such key {where} ({owner.__name__} has {', '.join(names)})"
    return line + (f"\ndid you mean {' or '.join(near)}?" if near else "")
