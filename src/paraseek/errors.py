"""User-facing errors: a mistake in the input ends the command with exit code 2 and one line, no traceback; and the
one-line readers of user files."""

from __future__ import annotations

import errno
import json
import os
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path


class UserError(Exception):
    """Bad input from the user (unknown preset, missing file, impossible plan). The message says what, where and how
    to fix it; the CLI prints it as one line and exits with code 2."""


def first_line(e: Exception) -> str:
    """An exception's message cut to its first line (a library's multi-line error inside a one-line UserError)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def read_parsed(path: Path, label: str, kind: str) -> object:
    """A user's whole JSON or TOML file parsed (`kind` names the format as the message should: "JSON", "valid JSON",
    "valid TOML"); a file that is not that format, not UTF-8 or cannot be read is one UserError starting `label`."""
    try:
        text = path.read_text(encoding="utf-8")
        return tomllib.loads(text) if kind.endswith("TOML") else json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{label}: not {kind} ({e.msg} at line {e.lineno})") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{label}: not {kind} ({e})") from None
    except UnicodeDecodeError:
        raise UserError(f"{label}: not {kind} (not UTF-8 text: a binary file?)") from None
    except OSError as e:
        raise UserError(f"{label}: cannot be read ({e.strerror or type(e).__name__})") from None


def read_jsonl_objects(path: str | Path, what: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-empty line of a user's .jsonl file; a missing file, a line that is not
    JSON or not an object is one UserError naming the file and line. `what` says what an object should hold."""
    for n, row, _ in read_jsonl_rows(path, what):
        yield n, row


def read_jsonl_rows(path: str | Path, what: str) -> Iterator[tuple[int, dict, int]]:
    """read_jsonl_objects with each line's size in bytes (for progress over a large file)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        f = path.open("rb")
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            except UnicodeDecodeError:
                raise UserError(f"{path}:{n}: not UTF-8 text") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{n}: expected an object with {what}")
            yield n, row, len(line)


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


# Why a probe file could not be made, in the user's words (errno's own text for the rest).
_CANNOT_WRITE = {errno.EROFS: "a read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "permission denied", errno.ENOSPC: "no space left on the disk",
                 errno.EDQUOT: "the disk quota is used up",
                 errno.ENOENT: "a virtual file system that takes no new files"}


def check_writable(what: str, path: str, folder: bool) -> None:
    """An output path (a `folder` or a file) that the command will write or make later, refused now if it cannot
    be: a file where a folder is meant or the reverse, a file in the way of the folders to make, or a folder (the
    path itself or its nearest existing parent) in which no file can be made. That last one is tried, not asked
    (os.access says yes to root on a read-only mount or /proc): a probe file is made there and removed at once, so a
    refused command leaves nothing behind. An existing file is opened for appending, which changes nothing."""
    p = Path(path).expanduser().absolute()
    if p.exists() and p.is_dir() != folder:
        raise UserError(f"{what} {path}: that is a {'file' if folder else 'folder'}; give a "
                        f"{'folder' if folder else 'file'} path")
    start = p if folder else p.parent
    ancestor = next(a for a in (start, *start.parents) if a.exists())
    if not ancestor.is_dir():
        raise UserError(f"{what} {path}: {ancestor} is a file, so no folder can be made there")
    target = p if p.is_file() else ancestor
    try:
        if p.is_file():
            with open(p, "ab"):
                pass
        else:
            fd, probe = tempfile.mkstemp(prefix=".paraseek-probe-", dir=ancestor)
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        why = _CANNOT_WRITE.get(e.errno, e.strerror or type(e).__name__)
        raise UserError(f"{what} {path}: {target} cannot be written ({why}); give a path this user can write") \
            from None


def check_plot(path: str | None) -> None:
    """--plot FILE.png of the benchmarks and the planner, checked before anything is measured: matplotlib is there
    and the file can be written (its folder is made when it is missing)."""
    if not path:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    check_writable("--plot", path, folder=False)
