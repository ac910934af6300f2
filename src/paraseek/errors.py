"""User-facing errors: a mistake in the input ends the command with exit code 2 and one line, no traceback; and the
one-line readers of user files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


class UserError(Exception):
    """Bad input from the user (unknown preset, missing file, impossible plan). The message says what, where and how
    to fix it; the CLI prints it as one line and exits with code 2."""


def read_jsonl_objects(path: str | Path, what: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-empty line of a user's .jsonl file; a missing file, a line that is not
    JSON or not an object is one UserError naming the file and line. `what` says what an object should hold."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{n}: expected an object with {what}")
            yield n, row


def parse_range(spec: str, what: str) -> tuple[int, int]:
    """A length given as N or LO:HI (inclusive), both >= 1, as the benchmarks take them."""
    try:
        lo, _, hi = spec.partition(":")
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise UserError(f"{what} must be N or LO:HI with integers, got {spec!r}") from None
    if not 1 <= lo_i <= hi_i:
        raise UserError(f"{what} must be N or LO:HI with 1 <= LO <= HI, got {spec!r}")
    return lo_i, hi_i
