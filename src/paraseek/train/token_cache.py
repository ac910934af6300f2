"""The token cache: a corpus tokenized once into $PARASEEK_CACHE/tokens, memory-mapped after that. Text is one
uint32 stream, each document's ids followed by the tokenizer's eos; chat is a folder of the rendered conversations'
ids, each token's role (train/chat.py) and the conversations' offsets. The key of a cache covers everything it
depends on, and each is built once per node, whole (build_once)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import NoReturn

import numpy as np

from paraseek.errors import UserError, first_line
from paraseek.models.tokenizer import EOS_NAMES
from paraseek.train.chat import ChatEncoder
from paraseek.train.corpus import iter_chat_rows, iter_documents

CACHE_VERSION = 1  # bump when the cached stream's meaning changes, so old caches are not reused
PROGRESS_MIN_BYTES = 4 << 20  # below this tokenizing takes about a second: no progress bar


def cache_dir() -> Path:
    """$PARASEEK_CACHE/tokens, default ~/.cache/paraseek/tokens."""
    root = os.environ.get("PARASEEK_CACHE") or Path.home() / ".cache" / "paraseek"
    return Path(root).expanduser() / "tokens"


def document_end(tok) -> int:
    """The id written between documents: the tokenizer's eos (models/tokenizer.py: the one rule for every command)."""
    if tok.eos_token_id is None:
        raise UserError(f"--tokenizer {tok.file}: no end-of-document token (no eos_token named, and none of "
                        f"{', '.join(EOS_NAMES)}); add one, or name it as eos_token in a tokenizer_config.json beside "
                        f"it")
    return tok.eos_token_id


def cache_path(files: list[Path], tok, eos: int) -> Path:
    """The cache key covers everything the stream depends on: which files (path, size, mtime) and which tokenizer
    (its bytes, not its path, so an edited tokenizer.json in the same place retokenizes; and the special tokens its
    tokenizer_config.json names, which encode whole)."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    tok_hash = hashlib.sha256(tok.file.read_bytes()).hexdigest()
    key = json.dumps({"v": CACHE_VERSION, "files": stats, "tokenizer": tok_hash, "specials": tok.specials, "eos": eos},
                     sort_keys=True)
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.u32"


def cached_tokens(files: list[Path], tok, eos: int) -> np.ndarray:
    """The corpus' token stream (uint32, memory-mapped), tokenizing it first when no cache holds it.

    Several ranks of one node start here together: an exclusive flock lets one tokenize while the others wait and
    then read its file (build_once). On file systems where flock does not lock across nodes each node tokenizes the
    same stream and the last rename wins harmlessly."""
    path = cache_path(files, tok, eos)
    build_once(path, lambda tmp: tokenize_into(tmp, files, tok, eos))
    size = path.stat().st_size
    if not path.is_file():
        _damaged(path, "a folder where the file of token ids belongs")
    if size % 4:
        _damaged(path, f"{size:,} bytes, not a whole number of 4-byte token ids")
    if size == 0:  # np.memmap refuses empty files
        return np.zeros(0, dtype="<u4")
    return np.memmap(path, dtype="<u4", mode="r")


def tokenize_into(out: Path, files: list[Path], tok, eos: int, batch_chars: int = 8 << 20) -> None:
    """Encode every document, append `eos` after each, and stream the ids to `out` as raw little-endian uint32
    (so memory stays bounded by one batch, whatever the corpus size)."""
    total = sum(f.stat().st_size for f in files)
    show = os.environ.get("LOCAL_RANK", "") in ("", "0") and total >= PROGRESS_MIN_BYTES
    with open(out, "wb") as f, _progress(show, total) as advance:
        texts: list[str] = []

        def flush() -> None:
            # encode_batch runs on all cores (the Rust side); special tokens are not added, we place eos ourselves
            ids = [x + [eos] for x in tok.encode_batch(texts, add_special_tokens=False)]
            if ids:
                f.write(np.concatenate([np.asarray(x, dtype="<u4") for x in ids]).tobytes())
            texts.clear()

        size = 0
        for text, nbytes in iter_documents(files):
            texts.append(text)
            size += len(text)
            advance(nbytes)
            if size >= batch_chars:
                flush()
                size = 0
        flush()


def chat_cache_path(files: list[Path], tok) -> Path:
    """As cache_path, plus everything the rendering depends on: the templates, the named special tokens and the
    end-of-turn ids (train/chat.py extends assistant spans over them)."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = json.dumps({"v": CACHE_VERSION, "kind": "chat", "files": stats,
                      "tokenizer": hashlib.sha256(tok.file.read_bytes()).hexdigest(), "templates": tok.chat_templates,
                      "specials": tok.specials, "eos": tok.eos_token_id, "stops": tok.stop_token_ids}, sort_keys=True)
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.chat"


def cached_chat(files: list[Path], tok) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """(token ids uint32, roles uint8 (train/chat.py), document offsets int64 [n + 1], {"rows", "unlocated"}) of a
    chat corpus, rendering and tokenizing it first when no cache holds it: a folder made by build_once."""
    path = chat_cache_path(files, tok)

    def build(tmp: Path) -> None:
        tmp.mkdir()
        render_into(tmp, files, ChatEncoder(tok))

    build_once(path, build)
    try:
        meta = json.loads((path / "meta.json").read_text())
        sizes = {name: (path / name).stat().st_size for name in ("tokens.u32", "roles.u8", "docs.i64")}
        docs = np.fromfile(path / "docs.i64", dtype="<i8") if sizes["docs.i64"] % 8 == 0 else None
    except (OSError, ValueError) as e:
        _damaged(path, f"{Path(e.filename).name}: {e.strerror}" if isinstance(e, OSError) and e.filename else
                 first_line(e))
    n = sizes["tokens.u32"] // 4
    if (sizes["tokens.u32"] % 4 or sizes["roles.u8"] != n or docs is None or not isinstance(meta, dict)
            or meta.get("rows") != len(docs) - 1 or docs[0] != 0 or docs[-1] != n):
        _damaged(path, "its token, role and document files do not agree")

    def load(name: str, dtype: str) -> np.ndarray:
        return np.memmap(path / name, dtype=dtype, mode="r") if sizes[name] else np.zeros(0, dtype=dtype)

    return load("tokens.u32", "<u4"), load("roles.u8", "u1"), docs, meta


def render_into(out: Path, files: list[Path], encoder: ChatEncoder) -> None:
    """Render and tokenize every chat row into out/tokens.u32, out/roles.u8, out/docs.i64 (offsets) and
    out/meta.json, streaming (memory bounded by one row)."""
    total = sum(f.stat().st_size for f in files)
    show = os.environ.get("LOCAL_RANK", "") in ("", "0") and total >= PROGRESS_MIN_BYTES
    docs, unlocated = [0], 0
    with open(out / "tokens.u32", "wb") as ft, open(out / "roles.u8", "wb") as fr, _progress(show, total) as advance:
        for row, where, nbytes in iter_chat_rows(files):
            ids, roles, missed = encoder.encode(row, where)
            ft.write(np.asarray(ids, dtype="<u4").tobytes())
            fr.write(np.asarray(roles, dtype="u1").tobytes())
            docs.append(docs[-1] + len(ids))
            unlocated += missed
            advance(nbytes)
    if len(docs) == 1:
        raise UserError(f"{files[0]}: no rows to train on")
    np.asarray(docs, dtype="<i8").tofile(out / "docs.i64")
    (out / "meta.json").write_text(json.dumps({"rows": len(docs) - 1, "unlocated": unlocated}))


def build_once(path: Path, build) -> None:
    """Make `path` (a file or a folder) with build(tmp) unless it exists: under an exclusive flock, so that the
    ranks of a node build it once, and whole (tmp + os.replace), so that a crash never leaves half of it. A cache
    that cannot be written (a full disk) is one UserError; the input files' own errors are theirs."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # read-only is enough for flock, and lets another user read a cache made by someone else
        lock = os.open(path.with_suffix(".lock"), os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"the token cache {path.parent} cannot be written ({e.strerror}); set $PARASEEK_CACHE to a "
                        f"folder this user can write") from None
    with os.fdopen(lock) as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if path.exists():
            return
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            build(tmp)
            os.replace(tmp, path)
        except OSError as e:
            raise UserError(f"the token cache {path.parent} cannot be written ({e.strerror}); free space there or set "
                            f"$PARASEEK_CACHE to another folder") from None
        finally:
            if tmp.is_dir():
                shutil.rmtree(tmp)
            else:
                tmp.unlink(missing_ok=True)


def _damaged(path: Path, why: str) -> NoReturn:
    raise UserError(f"the token cache {path} is damaged ({why}): delete it and run again (it is made again from the "
                    f"data)")


class _progress:
    """A rich progress bar over input bytes on stderr (stdout may carry --json), or nothing."""

    def __init__(self, show: bool, total: int):
        self.bar = None
        if show:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                                console=Console(stderr=True))
            self.task = self.bar.add_task("tokenizing", total=total)

    def __enter__(self):
        if self.bar is None:
            return lambda n: None
        self.bar.start()
        return lambda n: self.bar.advance(self.task, n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
