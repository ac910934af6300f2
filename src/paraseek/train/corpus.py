"""The corpus of `paraseek train --data`: the files a path names (.txt, .jsonl, .parquet, or a folder of them),
whether they hold text or chat rows, and their documents or rows read one at a time; a file that is not what its name
says is one line naming it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from paraseek.errors import UserError, first_line, read_jsonl_rows
from paraseek.train.chat import row_kind

BUNDLED_CORPUS = Path(__file__).resolve().parent.parent / "assets" / "corpus"  # public-domain English, see SOURCE.md
SUFFIXES = (".txt", ".jsonl", ".parquet")


def list_files(data: str | os.PathLike) -> list[Path]:
    path = Path(data).expanduser()
    if not path.exists():
        raise UserError(f"--data {data}: no such file or folder (give 'synthetic', a .txt/.jsonl/.parquet file or a "
                        f"folder of them)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise UserError(f"--data {data}: the folder holds no {', '.join(SUFFIXES)} files")
    elif path.suffix in SUFFIXES:
        files = [path]
    else:
        raise UserError(f"--data {data}: unsupported file type {path.suffix!r} (use {', '.join(SUFFIXES)})")
    if any(f.suffix == ".parquet" for f in files):
        _pyarrow(files[0])  # fail now, not after tokenizing the other files
    return files


def data_kind(files: list[Path]) -> str:
    """"chat" or "text": what the first row of each file holds (a .txt file is text); one kind per corpus."""
    kinds = {}
    for path in files:
        if path.suffix == ".txt":
            kinds[path] = "text"
        elif path.suffix == ".jsonl":
            row = next((row for row, _, _ in _jsonl_rows(path)), {})
            kinds[path] = row_kind(row) or "text"  # a row of neither kind fails with its line number later
        else:
            names = _parquet_file(path).schema_arrow.names
            kinds[path] = "chat" if {"messages", "prompt"} & set(names) else "text"
    if len(set(kinds.values())) > 1:
        chat = next(f for f, k in kinds.items() if k == "chat")
        text = next(f for f, k in kinds.items() if k == "text")
        raise UserError(f"{chat} holds chat rows but {text} holds text: give one kind of data per --data (a folder "
                        f"of chat files or of text files)")
    return next(iter(kinds.values()))


def iter_documents(files: list[Path]) -> Iterator[tuple[str, int]]:
    """(document text, input bytes it stands for) in file order; the bytes only drive the progress bar."""
    for path in files:
        if path.suffix == ".txt":
            yield _read_text(path)
        elif path.suffix == ".jsonl":
            for doc, where, nbytes in _jsonl_rows(path):
                if not isinstance(doc.get("text"), str):
                    raise UserError(f'{where}: no "text" field (each line must be an object with a "text" string, '
                                    f'or, in a chat corpus, "messages" or "prompt" and "completion")')
                yield doc["text"], nbytes
        else:  # .parquet
            pf = _parquet_file(path)
            if "text" not in pf.schema_arrow.names:
                raise UserError(f'{path}: no "text" column (columns: {", ".join(pf.schema_arrow.names)})')
            for text, nbytes in _parquet_rows(path, ["text"]):
                if text["text"] is not None:  # a null row is no document
                    yield text["text"], nbytes


def iter_chat_rows(files: list[Path]) -> Iterator[tuple[dict, str, int]]:
    """(chat row, where it is: file:line or file row N, input bytes) in file order."""
    for path in files:
        if path.suffix == ".jsonl":
            for row, where, nbytes in _jsonl_rows(path):
                if row_kind(row) != "chat":
                    raise UserError(f'{where}: no "messages" field (each line of a chat corpus must be an object '
                                    f'with "messages", or "prompt" and "completion")')
                yield row, where, nbytes
        else:
            names = _parquet_file(path).schema_arrow.names
            columns = [c for c in ("messages", "tools", "prompt", "completion") if c in names]
            for i, (row, nbytes) in enumerate(_parquet_rows(path, columns)):
                yield {k: v for k, v in row.items() if v is not None}, f"{path} row {i}", nbytes


def _jsonl_rows(path: Path) -> Iterator[tuple[dict, str, int]]:
    """(object, "FILE:LINE", bytes) per line of a training .jsonl file."""
    what = 'a "text" string, or "messages", or "prompt" and "completion"'
    for n, row, nbytes in read_jsonl_rows(path, what):
        yield row, f"{path}:{n}", nbytes


def _read_text(path: Path) -> tuple[str, int]:
    """A .txt document and its size in bytes. A stray bad byte becomes U+FFFD rather than stopping a long run; a file
    with NUL bytes is not text (a binary file, or UTF-16) and is refused."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if b"\0" in raw:
        raise UserError(f"{path}: not UTF-8 text (it holds NUL bytes: a binary file, or UTF-16 text); give text files")
    return raw.decode("utf-8", errors="replace"), len(raw)


def _pyarrow(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading .parquet files needs pyarrow: pip install pyarrow") from None
    return pq


def _parquet_file(path: Path):
    """pyarrow's ParquetFile of `path`: a file that is not parquet, or is cut short, is one UserError."""
    pq = _pyarrow(path)
    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, its IO errors OSErrors
        raise UserError(f"{path}: not a readable parquet file ({first_line(e)})") from None


def _parquet_rows(path: Path, columns: list[str]) -> Iterator[tuple[dict, int]]:
    pf = _parquet_file(path)
    rows = max(pf.metadata.num_rows, 1)
    batches = pf.iter_batches(columns=columns, batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
        except (OSError, ValueError) as e:  # a damaged row group
            raise UserError(f"{path}: a damaged parquet row group ({first_line(e)})") from None
        if batch is None:
            return
        share = path.stat().st_size * batch.num_rows // rows
        for i, row in enumerate(batch.to_pylist()):
            yield row, share if i == 0 else 0
