"""A setting is declared once: its default, help text and choices live on its dataclass field, and
every command line that offers it builds the option from there (``add_options``), so ``leanbp
train``, ``bench``, ``plan`` and ``verify`` cannot drift apart.

    chunk_size: int = setting(1024, help="rows per chunk")    # a field of a config dataclass

The option is ``--chunk-size``; a bool defaulting to False becomes a flag (``--offload``), one
defaulting to True a ``--no-...`` flag. Validation stays in the dataclass (``__post_init__``), which
every entry point (Python, CLI, bench, plan) goes through.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

_MISSING = dataclasses.MISSING


def setting(default: Any, *, help: str, choices: tuple | None = None, parse: Callable[[str], Any] | None = None,
            metavar: str | None = None):
    """A dataclass field with what the command line needs to offer it: ``help``, ``choices``,
    ``parse`` (text -> value; default: the type of the default) and ``metavar``."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "parse": parse,
                                                        "metavar": metavar})


def flag_of(name: str, default: Any = None) -> str:
    """The command-line option of field ``name`` (``--no-...`` for a bool that defaults to True)."""
    option = name.replace("_", "-")
    return f"--no-{option}" if default is True else f"--{option}"


def field_default(cls, name: str):
    """The default of field ``name`` of the dataclass ``cls`` (its factory's value for a list or a
    config); an error for a field without one."""
    f = cls.__dataclass_fields__.get(name)
    if f is None:
        raise KeyError(f"{cls.__name__} has no setting {name!r}")
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        return f.default_factory()
    raise ValueError(f"{cls.__name__}.{name} has no default to offer on the command line")


def add_options(parser: argparse.ArgumentParser, cls, names, defaults: dict | None = None) -> None:
    """Add an option for each field ``names`` of the dataclass ``cls``; ``defaults`` replaces a
    field's default for this command (the help then shows that one)."""
    for name in names:
        meta = cls.__dataclass_fields__[name].metadata if name in cls.__dataclass_fields__ else {}
        if "help" not in meta:
            raise KeyError(f"{cls.__name__}.{name} is not declared with setting(...)")
        default = (defaults or {}).get(name, field_default(cls, name))
        text = meta["help"].replace("%", "%%")
        if isinstance(default, bool):
            parser.add_argument(flag_of(name, default), dest=name, action="store_false" if default else "store_true",
                                help=text)
            continue
        parse = meta["parse"] or (type(default) if default is not None else str)
        shown = "" if default is None else f" (default: {default})"  # (None: the help says what happens)
        parser.add_argument(flag_of(name), dest=name, type=_named(parse), default=default,
                            choices=meta["choices"], metavar=meta["metavar"], help=text + shown)


def _named(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, with a ValueError turned into argparse's message (which names the option)."""
    def parsed(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parsed.__name__ = getattr(parse, "__name__", "value")
    return parsed


def values(args: argparse.Namespace, names) -> dict[str, Any]:
    """The parsed values of the options ``names`` (as ``add_options`` named them)."""
    return {name: getattr(args, name) for name in names}
