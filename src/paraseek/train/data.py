"""Training data: tokenize a corpus once (cached), cut it into fixed windows, and give each data-parallel rank its
slice of every optimizer step.

The layout rule that makes 1 process and N processes train on exactly the same tokens, step by step:
  step s consumes the global positions [s*B, (s+1)*B)            (B = global batch size, in sequences)
  dp rank r of dp takes the contiguous slice [r*B/dp, (r+1)*B/dp) of them, cut into micro-batches of m in order
  position p -> sequence perm_e[p % N], e = p // N                 (N sequences, perm_e seeded by (seed, epoch e))
So the union over ranks of a step is the same for every dp size, and one process that accumulates B/m micro-batches
sees the same sequences in the same order. Synthetic data has no epochs: sequence i is drawn from a generator seeded
by (seed, i).

What a window holds (W = seq_len + 1 tokens):
  text, --pack true (default)   the corpus' token stream (each document's ids, then eos) cut into consecutive
                                windows, as pre-training does; attention spans the documents of a window unless
                                --doc-mask true, which restarts positions after each eos (TorchTitan finds document
                                boundaries the same way) and masks attention to each document
  chat, --pack true (default)   whole conversations, next-fit in file order (a new window when the next one does not
                                fit), the rest padded; --doc-mask defaults to true for chat: positions restart and
                                attention stays inside each conversation. A conversation is never cut across windows
                                (its second half would lose the context its answers depend on): one longer than W
                                keeps its first W tokens (--overlong truncate) or is dropped (--overlong drop), and
                                one left with no trained token is dropped; both are counted in the data summary
  --pack false                  one conversation per row (text: one W-token piece of a document per row), padded
The labels are the window's tokens shifted by one; a label is ignored (models/loss.py IGNORE_INDEX) where the token is
not trained: padding, a document's first token (nothing in its document predicts it), and for chat the tokens
`--loss-on` leaves out (train/chat.py: roles). A micro-batch is (inputs [m, T], labels [m, T]), plus positions
[m, T] (each token's position in its document) when attention is masked per document.

Shapes (models/deepseek.py's letters): a window is W = T + 1 tokens (inputs [:-1], labels [1:]); one rank reads B =
global batch / dp of them per step, in micro-batches of m.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from paraseek.errors import UserError, first_line, read_jsonl_rows
from paraseek.models.loss import IGNORE_INDEX
from paraseek.models.tokenizer import BUNDLED_TOKENIZER, EOS_NAMES, load_text_tokenizer
from paraseek.seeding import derive_seed
from paraseek.train.chat import ASSISTANT, LAST, ChatEncoder, row_kind

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_CORPUS = ASSETS / "corpus"  # public-domain English text, see its SOURCE.md
SUFFIXES = (".txt", ".jsonl", ".parquet")
CACHE_VERSION = 1  # bump when the cached stream's meaning changes, so old caches are not reused
PROGRESS_MIN_BYTES = 4 << 20  # below this tokenizing takes about a second: no progress bar


class Dataset:
    """Fixed windows of seq_len + 1 tokens: cut from a cached token stream, or random tokens (data="synthetic").
    `doc_mask`: positions restart after each eos and attention stays inside each document."""

    def __init__(self, *, seq_len: int, vocab_size: int, seed: int, tokens: np.ndarray | None = None,
                 source: str = "synthetic", eos_id: int | None = None, tokenizer_vocab: int | None = None,
                 doc_mask: bool = False):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.tokens, self.source, self.eos_id = tokens, source, eos_id
        self.tokenizer_vocab = tokenizer_vocab  # the tokenizer's size, with added tokens (None: synthetic)
        # the remainder after the last full window is dropped
        self.num_sequences: int | None = None if tokens is None else len(tokens) // (seq_len + 1)
        self.has_positions = doc_mask
        self.every_label_counts = not doc_mask  # the loss normalizer is then known without counting
        self.summary = "" if tokens is None else (
            f"{source}: {len(tokens):,} tokens -> {self.num_sequences:,} windows of {seq_len + 1:,} tokens (the "
            f"stream cut into windows; " + ("attention masked to each document, positions restarting after each "
                                            "eos)" if doc_mask else "attention across the documents of a window)"))

    @property
    def num_tokens(self) -> int | None:
        return None if self.tokens is None else len(self.tokens)

    def sequence(self, index: int) -> torch.Tensor:
        """Window `index` as int64 [W] (W = T + 1: seq_len + 1 tokens)."""
        if self.tokens is None:
            g = torch.Generator().manual_seed(derive_seed(self.seed, "synthetic", index))
            return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)
        if not 0 <= index < self.num_sequences:
            raise IndexError(f"sequence {index} of {self.num_sequences}")
        w = self.seq_len + 1
        return torch.from_numpy(self.tokens[index * w:(index + 1) * w].astype(np.int64))

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(tokens [W], which are trained (None: all), positions [W] (None: 0..W-1))."""
        tokens_W = self.sequence(index)
        if not self.has_positions:
            return tokens_W, None, None
        t_W = torch.arange(len(tokens_W))
        starts_W = torch.zeros(len(tokens_W), dtype=torch.bool)
        starts_W[1:] = tokens_W[:-1] == self.eos_id  # a document starts after each eos
        last_start_W = torch.where(starts_W, t_W, 0).cummax(0).values
        positions_W = t_W - last_start_W
        return tokens_W, positions_W != 0, positions_W


class PackedDataset:
    """Windows of whole documents (the module docstring's chat and --pack false rows), built once at open from the
    tokenized documents: a table of segments (token offset, length), window i holding segments
    win_start[i]:win_start[i+1], padded with `pad_id` to W tokens."""

    def __init__(self, *, seq_len: int, vocab_size: int, seed: int, tokens: np.ndarray, starts: np.ndarray,
                 roles: np.ndarray | None, source: str, pad_id: int, pack: bool, doc_mask: bool,
                 loss_on: str = "all", overlong: str = "truncate", meta: dict | None = None,
                 tokenizer_vocab: int | None = None):
        self.seq_len, self.vocab_size, self.seed, self.source = seq_len, vocab_size, seed, source
        self.tokenizer_vocab = tokenizer_vocab  # the tokenizer's size, with added tokens
        self.tokens, self.roles, self.pad_id, self.loss_on = tokens, roles, pad_id, loss_on
        self.has_positions, self.every_label_counts = doc_mask, False
        W = seq_len + 1
        off, n = starts[:-1].astype(np.int64), np.diff(starts).astype(np.int64)
        n_docs, notes = len(n), []
        if roles is None:  # text, one row per piece: every W-token piece of every document
            pieces = -(-n // W)
            doc = np.repeat(np.arange(len(n)), pieces)
            k = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # the piece's index in its doc
            off, n = off[doc] + k * W, np.minimum(W, n[doc] - k * W)
            keep = n > 1  # a 1-token piece predicts nothing
            if (~keep).any():
                notes.append(f"{int((~keep).sum()):,} one-token pieces dropped")
        else:
            long_ = n > W
            keep = ~long_ if overlong == "drop" else np.ones(len(n), dtype=bool)
            n = np.minimum(n, W)
            useful = self._segment_trained(off, n) > 0  # what a (truncated) conversation keeps
            if long_.any():
                notes.append(f"{int(long_.sum()):,} longer than {W:,} tokens " +
                             ("dropped" if overlong == "drop" else f"truncated to their first {W:,}"))
            if (keep & ~useful).any():
                notes.append(f"{int((keep & ~useful).sum()):,} dropped with no trained token (--loss-on {loss_on})")
            keep &= useful
        self.seg_off, self.seg_len = off[keep], n[keep]
        if len(self.seg_len) == 0:
            raise UserError(f"{source}: no document is left to train on ({'; '.join(notes) or 'empty'})")
        self.win_start = _next_fit(self.seg_len, W) if pack else np.arange(len(self.seg_len) + 1)
        self.num_sequences = len(self.win_start) - 1
        n_trained = int(self._segment_trained(self.seg_off, self.seg_len).sum())
        padding = 1 - self.seg_len.sum() / (self.num_sequences * W)
        what = (f"{meta['rows']:,} conversations" if meta else f"{n_docs:,} documents")
        layout = ((f"packed, attention {'masked to each document' if doc_mask else 'across the documents of a window'}")
                  if pack else "one per row")
        if meta and meta.get("unlocated"):
            notes.append(f"{meta['unlocated']:,} assistant tool-call turns not trained (content null: the template "
                         f"has no {{% generation %}} tags to locate them by)")
        self.summary = (f"{source}: {what}, {len(tokens):,} tokens -> {self.num_sequences:,} windows of {W:,} tokens "
                        f"({layout}, {padding:.1%} padding); loss on {'every token' if roles is None else loss_on} "
                        f"({n_trained:,} trained tokens){''.join('; ' + x for x in notes)}")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def _trained(self, a: int, b: int) -> np.ndarray:
        """Which of tokens[a:b] --loss-on trains (every token of text)."""
        if self.roles is None or self.loss_on == "all":
            return np.ones(b - a, dtype=bool)
        roles = np.asarray(self.roles[a:b])
        return roles == LAST if self.loss_on == "last-turn" else roles >= ASSISTANT

    def _segment_trained(self, off: np.ndarray, n: np.ndarray, chunk: int = 1 << 24) -> np.ndarray:
        """Trained tokens of each segment tokens[off:off + n] but its first (nothing in its document predicts it),
        for segments in corpus order; the roles are read `chunk` tokens at a time (a cumulative count over the whole
        corpus would hold 9 bytes per token)."""
        if self.roles is None:
            return np.maximum(n - 1, 0)
        out = np.zeros(len(off), dtype=np.int64)
        i = 0
        while i < len(off):
            j = max(i + 1, int(np.searchsorted(off, off[i] + chunk)))
            a, b = int(off[i]), int((off[i:j] + n[i:j]).max())
            counts = np.concatenate([[0], np.cumsum(self._trained(a, b), dtype=np.int64)])
            out[i:j] = np.maximum(counts[off[i:j] - a + n[i:j]] - counts[np.minimum(off[i:j] - a + 1, b - a)], 0)
            i = j
        return out

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not 0 <= index < self.num_sequences:
            raise IndexError(f"window {index} of {self.num_sequences}")
        W = self.seq_len + 1
        segs = range(int(self.win_start[index]), int(self.win_start[index + 1]))
        pieces = [(int(self.seg_off[s]), int(self.seg_len[s])) for s in segs]
        used = sum(n for _, n in pieces)
        tokens_W = np.full(W, self.pad_id, dtype=np.int64)
        trained_W = np.zeros(W, dtype=bool)
        positions_W = np.arange(W) - used  # the padding: a document of its own
        at = 0
        for a, n in pieces:
            tokens_W[at:at + n] = self.tokens[a:a + n]
            trained_W[at + 1:at + n] = self._trained(a + 1, a + n)  # a document's first token predicts nothing
            positions_W[at:at + n] = np.arange(n)
            at += n
        positions = torch.from_numpy(positions_W) if self.has_positions else None
        return torch.from_numpy(tokens_W), torch.from_numpy(trained_W), positions

    def sequence(self, index: int) -> torch.Tensor:
        return self.window(index)[0]


def _next_fit(lengths: np.ndarray, W: int) -> np.ndarray:
    """Window boundaries over segments taken in order: a segment that does not fit the current window starts a new
    one (next-fit: order kept, deterministic, at most one window in flight)."""
    bounds, fill = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if fill + n > W:
            bounds.append(i)
            fill = 0
        fill += n
    bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


class Subset:
    """The windows `indices` of a dataset (an --eval-split carve-out, or the rest for training), in that order."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, [int(i) for i in indices]
        self.num_sequences, self.seed = len(self.indices), dataset.seed
        self.seq_len, self.has_positions = dataset.seq_len, dataset.has_positions
        self.every_label_counts = dataset.every_label_counts

    def window(self, index: int):
        return self.dataset.window(self.indices[index])

    def sequence(self, index: int) -> torch.Tensor:
        return self.window(index)[0]


def split_eval(dataset, fraction: float, seed: int) -> tuple[Subset, Subset]:
    """(train, eval): round(fraction x windows) windows (at least one), picked by a permutation seeded by (seed,
    "eval-split") before any epoch shuffle, so every layout and every resume holds out the same ones. A chat window
    holds whole conversations, so a held-out conversation is never trained on; a text document cut across a held-out
    window's edge is partly on both sides."""
    n = dataset.num_sequences
    if n is None:
        raise UserError("--eval-split carves windows out of a corpus; synthetic data has none (give --eval-data, "
                        "or --data FILES)")
    k = max(1, round(fraction * n))
    if k >= n:
        raise UserError(f"--eval-split {fraction}: holding out {k:,} of {n:,} windows leaves none to train on")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, "eval-split"))).tolist()
    return Subset(dataset, sorted(perm[k:])), Subset(dataset, sorted(perm[:k]))


def open_dataset(data: str, *, seq_len: int, vocab_size: int, tokenizer: str | None = None, seed: int = 0,
                 pack: bool = True, doc_mask: str = "auto", loss_on: str = "assistant", overlong: str = "truncate",
                 chat_template: str | None = None):
    """`data` is "synthetic", a .txt (one document per file), .jsonl (a "text", "messages" or "prompt" +
    "completion" field per line) or .parquet (the same columns) file, or a folder of them (searched recursively, read
    in sorted order); one kind of rows per corpus. `tokenizer` is an HF tokenizer.json or a folder holding one (a
    chat corpus needs the folder's chat template, or `chat_template`, a Jinja file); None or "" = the bundled one.
    `pack`, `doc_mask` (auto: on for chat, off for text), `loss_on` and `overlong`: the module docstring."""
    assert seq_len > 0 and vocab_size > 0, (seq_len, vocab_size)
    if data == "synthetic":
        if doc_mask == "true" or not pack:
            raise UserError("--data synthetic is random tokens without documents: --doc-mask true and --pack false "
                            "need a corpus")
        return Dataset(seq_len=seq_len, vocab_size=vocab_size, seed=seed)
    files = list_files(data)
    if data_kind(files) == "chat":
        return _open_chat(files, str(data), seq_len=seq_len, vocab_size=vocab_size, tokenizer=tokenizer, seed=seed,
                          pack=pack, doc_mask=doc_mask != "false", loss_on=loss_on, overlong=overlong,
                          chat_template=chat_template)
    tok = load_text_tokenizer(tokenizer or BUNDLED_TOKENIZER)
    n_vocab = tok.vocab_size
    _check_vocab(n_vocab, tok.file, vocab_size)
    eos = document_end(tok)
    tokens = cached_tokens(files, tok, eos)
    if not pack:
        starts = np.concatenate([[0], np.flatnonzero(np.asarray(tokens) == eos) + 1])
        return PackedDataset(seq_len=seq_len, vocab_size=vocab_size, seed=seed, tokens=tokens, starts=starts,
                             roles=None, source=str(data), pad_id=eos, pack=False, doc_mask=False,
                             tokenizer_vocab=n_vocab)
    if len(tokens) < seq_len + 1:
        raise UserError(f"{data}: the corpus has {len(tokens):,} tokens, one sequence of --seq-len {seq_len} needs "
                        f"{seq_len + 1:,}; add text or lower --seq-len")
    return Dataset(seq_len=seq_len, vocab_size=vocab_size, seed=seed, tokens=tokens, source=str(data), eos_id=eos,
                   tokenizer_vocab=n_vocab, doc_mask=doc_mask == "true")


def _check_vocab(n_vocab: int, tok_file, vocab_size: int) -> None:
    if n_vocab > vocab_size:
        raise UserError(f"tokenizer {tok_file} has {n_vocab:,} tokens but the model's vocab_size is {vocab_size:,}: "
                        f"use a model whose vocab_size is at least {n_vocab:,}, or a smaller tokenizer")


def _open_chat(files: list[Path], source: str, *, seq_len: int, vocab_size: int, tokenizer: str | None, seed: int,
               pack: bool, doc_mask: bool, loss_on: str, overlong: str, chat_template: str | None) -> PackedDataset:
    tok = load_text_tokenizer(tokenizer or BUNDLED_TOKENIZER, chat_template or None)
    _check_vocab(tok.vocab_size, tok.name, vocab_size)
    tokens, roles, starts, meta = cached_chat(files, tok)
    pad = tok.eos_token_id if tok.eos_token_id is not None else 0
    return PackedDataset(seq_len=seq_len, vocab_size=vocab_size, seed=seed, tokens=tokens, starts=starts,
                         roles=roles, source=source, pad_id=pad, pack=pack, doc_mask=doc_mask and pack,
                         loss_on=loss_on, overlong=overlong, meta=meta, tokenizer_vocab=tok.vocab_size)


def open_training_data(cfg, vocab_size: int) -> tuple:
    """(training data, evaluation data or None) of a TrainConfig: --data with its packing flags, and --eval-data
    (read with the same tokenizer and rules) or the --eval-split windows carved out of --data."""
    opts = dict(seq_len=cfg.seq_len, vocab_size=vocab_size, tokenizer=cfg.tokenizer or None, seed=cfg.seed,
                pack=cfg.pack, doc_mask=cfg.doc_mask, loss_on=cfg.loss_on, overlong=cfg.overlong,
                chat_template=cfg.chat_template or None)
    train = open_dataset(cfg.data, **opts)
    if cfg.eval_data:
        return train, open_dataset(cfg.eval_data, **opts)
    if cfg.eval_split > 0:
        return split_eval(train, cfg.eval_split, cfg.seed)
    return train, None


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


def _pyarrow(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading .parquet files needs pyarrow: pip install pyarrow") from None
    return pq


def document_end(tok) -> int:
    """The id written between documents: the tokenizer's eos (models/tokenizer.py: the one rule for every command)."""
    if tok.eos_token_id is None:
        raise UserError(f"--tokenizer {tok.file}: no end-of-document token (no eos_token named, and none of "
                        f"{', '.join(EOS_NAMES)}); add one, or name it as eos_token in a tokenizer_config.json beside "
                        f"it")
    return tok.eos_token_id


def cache_dir() -> Path:
    """$PARASEEK_CACHE/tokens, default ~/.cache/paraseek/tokens."""
    root = os.environ.get("PARASEEK_CACHE") or Path.home() / ".cache" / "paraseek"
    return Path(root).expanduser() / "tokens"


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


def _damaged(path: Path, why: str) -> NoReturn:
    raise UserError(f"the token cache {path} is damaged ({why}): delete it and run again (it is made again from the "
                    f"data)")


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


class DataLoader:
    """This rank's micro-batches of each optimizer step, following the layout rule at the top of this file. The only
    state is the global position (sequences consumed by all ranks together), so a checkpoint taken with one dp size
    resumes exactly with another."""

    def __init__(self, dataset: Dataset, *, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, position: int = 0):
        per_step = dp_size * micro_batch_size
        if global_batch_size <= 0 or micro_batch_size <= 0 or global_batch_size % per_step:
            raise UserError(f"--global-batch-size {global_batch_size} is not a multiple of dp size {dp_size} x "
                            f"--micro-batch-size {micro_batch_size} = {per_step}: use a multiple of {per_step}")
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = position
        self._perms: dict[int, torch.Tensor] = {}  # epoch -> permutation; a step may straddle two epochs

    def _index(self, position: int) -> int:
        n = self.dataset.num_sequences
        if n is None:
            return position
        epoch = position // n
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(derive_seed(getattr(self.dataset, "seed", 0), "epoch", epoch))
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}  # keep only the previous one
            self._perms[epoch] = torch.randperm(n, generator=g)
        return int(self._perms[epoch][position % n])

    def next_step(self) -> list[tuple[torch.Tensor, ...]]:
        """[(inputs [m, T], labels [m, T])] * (B / m): this rank's B = global batch / dp sequences of one optimizer
        step; (inputs, labels, positions [m, T]) when attention is masked per document."""
        per_rank = self.global_batch_size // self.dp_size
        start = self.position + self.dp_rank * per_rank
        windows = [self.dataset.window(self._index(p)) for p in range(start, start + per_rank)]
        self.position += self.global_batch_size
        return collate(windows, self.micro_batch_size, self.dataset.has_positions)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self._perms = {}


def collate(windows: list, m: int, with_positions: bool) -> list[tuple[torch.Tensor, ...]]:
    """Windows (tokens [W], trained [W] or None, positions [W] or None) as micro-batches of m: inputs, labels
    (IGNORE_INDEX where the token is not trained) and, `with_positions`, the inputs' positions."""
    tokens_BW = torch.stack([t for t, _, _ in windows])
    inputs_BT, labels_BT = tokens_BW[:, :-1].contiguous(), tokens_BW[:, 1:].contiguous()
    if any(trained is not None for _, trained, _ in windows):
        trained_BW = torch.stack([torch.ones(len(t), dtype=torch.bool) if trained is None else trained
                                  for t, trained, _ in windows])
        labels_BT = labels_BT.masked_fill(~trained_BW[:, 1:], IGNORE_INDEX)
    parts = [inputs_BT, labels_BT]
    if with_positions:
        parts.append(torch.stack([torch.arange(len(t)) if p is None else p for t, _, p in windows])[:, :-1].contiguous())
    return [tuple(x[i:i + m] for x in parts) for i in range(0, len(windows), m)]


class EvalLoader:
    """This rank's share of the whole evaluation set, the same on every call: windows in index order, rank r of dp
    taking the r-th of dp contiguous slices, each padded to a multiple of `multiple` micro-batches of m with empty
    windows (no trained token), so that every rank runs the same number of forwards and the loss summed over ranks
    is that of the whole set whatever the layout."""

    def __init__(self, dataset, *, micro_batch_size: int, dp_rank: int, dp_size: int, multiple: int = 1):
        self.dataset, self.m = dataset, micro_batch_size
        n, per_batch = dataset.num_sequences, micro_batch_size * multiple
        self.per_rank = -(-(-(-n // dp_size)) // per_batch) * per_batch
        self.first = dp_rank * self.per_rank

    def batches(self) -> list[tuple[torch.Tensor, ...]]:
        W = self.dataset.seq_len + 1
        empty = (torch.zeros(W, dtype=torch.int64), torch.zeros(W, dtype=torch.bool), torch.arange(W))
        windows = [self.dataset.window(i) if i < self.dataset.num_sequences else empty
                   for i in range(self.first, self.first + self.per_rank)]
        return collate(windows, self.m, self.dataset.has_positions)
