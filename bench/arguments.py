"""The benchmarks' argument types: a value no run can use is a one-line usage error (exit
2) before anything loads, not a traceback, a hang or a report of nothing minutes later.

Comma-separated lists are checked item by item and kept as the text given (the commands
split them)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable


def _parsed(kind: type, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{'a whole number' if kind is int else 'a number'} is needed, "
                                         f"got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"a finite number is needed, got {text!r}")
    return value


def at_least(minimum: int | float, kind: type = int) -> Callable[[str], int | float]:
    """A number no smaller than `minimum`."""
    def parse(text: str):
        value = _parsed(kind, text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value
    return parse


def positive(text: str) -> float:
    """A number above 0 (a rate, a duration, a learning rate)."""
    value = _parsed(float, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    value = _parsed(float, text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


def listed(item: Callable[[str], object]) -> Callable[[str], str]:
    """Comma-separated values, each one `item` takes; the text as given."""
    def parse(text: str) -> str:
        for part in text.split(","):
            try:
                item(part.strip())
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"in {text!r}: {exc}") from None
        return text
    return parse


def one_of(*names: str) -> Callable[[str], str]:
    """One of `names`."""
    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"{text!r} is none of {', '.join(names)}")
        return text
    return parse


def output_path(text: str) -> str:
    """A file to write at the end of a run: its directory must exist before the run starts."""
    folder = Path(text).expanduser().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"no directory {str(folder)!r} to write {text!r} in")
    return text


def existing_file(text: str) -> str:
    """A file that exists (checked before any condition runs)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no file at {text!r}")
    return text


def named_file(text: str) -> str:
    """NAME=PATH, the file there."""
    name, equals, path = text.partition("=")
    if not (name and equals and Path(path).is_file()):
        raise argparse.ArgumentTypeError(f"NAME=TOML with an existing file is needed, got {text!r}")
    return text
